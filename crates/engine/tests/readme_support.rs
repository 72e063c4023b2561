//! The README's "Supported models" section says what the loader accepts: its table's
//! architectures and its list of tensor types are the engine's own.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::format::DType;
use pdserve_engine::model::supported_architectures;
use std::collections::BTreeSet;

fn section() -> String {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    let start = readme.find("## Supported models").expect("README has a Supported models section");
    let rest = &readme[start + 3..];
    rest[..rest.find("\n## ").unwrap_or(rest.len())].to_string()
}

#[test]
fn the_readme_table_names_every_supported_architecture() {
    let rows: BTreeSet<String> = section()
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .map(|l| l.split('`').next().unwrap().to_string())
        .collect();
    let supported: BTreeSet<String> = supported_architectures().split(", ").map(str::to_string).collect();
    assert_eq!(rows, supported);
}

#[test]
fn the_readme_lists_every_supported_tensor_type() {
    let section = section();
    let line = section.lines().find_map(|l| l.strip_prefix("Tensor types: ")).expect("a Tensor types line");
    let listed: BTreeSet<&str> = line.trim_end_matches('.').split(", ").collect();
    let supported: BTreeSet<&str> = DType::ALL.iter().map(|d| d.name()).collect();
    assert_eq!(listed, supported);
}
