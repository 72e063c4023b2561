//! What the host a node runs on has to spare: the memory a new process there could
//! take now, which a node reports so `pdserve split --nats` can place a stage group's
//! layers on the fleet's nodes.

/// Bytes a new process on this host could take now: the kernel's `MemAvailable`, or
/// less where a cgroup this process is in (v2, or v1's memory controller), or one
/// above it, leaves less room under its limit. `None` where none of it can be read.
pub fn memory_available() -> Option<u64> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let host = read("/proc/meminfo").and_then(|m| mem_available(&m));
    let capped = read("/proc/self/cgroup").and_then(|c| cgroup_room(&c, &read));
    match (host, capped) {
        (Some(h), Some(c)) => Some(h.min(c)),
        (h, c) => h.or(c),
    }
}

/// `MemAvailable` of a `/proc/meminfo`, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The least room (limit less usage) among the cgroups a `/proc/self/cgroup` names,
/// and the ones above them, that set a memory limit; `read` reads a file.
fn cgroup_room(cgroups: &str, read: &dyn Fn(&str) -> Option<String>) -> Option<u64> {
    let mut least: Option<u64> = None;
    for line in cgroups.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (fields.next(), fields.next(), fields.next()) else { continue };
        let (root, limit, usage) = match controllers {
            "" => ("/sys/fs/cgroup", "memory.max", "memory.current"),
            c if c.split(',').any(|c| c == "memory") => {
                ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes")
            }
            _ => continue,
        };
        let mut dir = path.trim_end_matches('/');
        loop {
            let number = |file: &str| read(&format!("{root}{dir}/{file}"))?.trim().parse::<u64>().ok();
            // "max" (no limit) does not parse, and is no limit.
            if let (Some(l), Some(u)) = (number(limit), number(usage)) {
                let room = l.saturating_sub(u);
                least = Some(least.map_or(room, |x| x.min(room)));
            }
            match dir.rfind('/') {
                Some(i) => dir = &dir[..i],
                None => break,
            }
        }
    }
    least
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn mem_available_is_read_in_bytes() {
        let meminfo = "MemTotal:       24000000 kB\nMemFree:  1000 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(mem_available(meminfo), Some(20_000_000 * 1024));
        assert_eq!(mem_available("MemTotal: 5 kB\n"), None);
        assert_eq!(mem_available("MemAvailable: lots kB\n"), None);
    }

    #[test]
    fn the_tightest_cgroup_on_the_way_up_bounds_the_room() {
        let files: HashMap<&str, &str> = [
            // v2: a group with 600 MB, 100 used, under a parent with 2 GB, 1.7 used.
            ("/sys/fs/cgroup/a/b/memory.max", "600000000\n"),
            ("/sys/fs/cgroup/a/b/memory.current", "100000000\n"),
            ("/sys/fs/cgroup/a/memory.max", "2000000000\n"),
            ("/sys/fs/cgroup/a/memory.current", "1700000000\n"),
            // v2, no limit.
            ("/sys/fs/cgroup/free/memory.max", "max\n"),
            ("/sys/fs/cgroup/free/memory.current", "5\n"),
            // v1's memory controller.
            ("/sys/fs/cgroup/memory/c/memory.limit_in_bytes", "400000000\n"),
            ("/sys/fs/cgroup/memory/c/memory.usage_in_bytes", "450000000\n"),
        ]
        .into();
        let read = |p: &str| files.get(p).map(|s| s.to_string());
        // (/proc/self/cgroup, the room)
        let cases: &[(&str, Option<u64>)] = &[
            ("0::/a/b\n", Some(300_000_000)),
            ("0::/a\n", Some(300_000_000)),
            ("0::/free\n", None),
            ("0::/\n", None),
            ("4:memory:/c\n3:cpu,cpuacct:/c\n0::/free\n", Some(0)),
            ("5:cpu:/a/b\n", None),
            ("garbage\n", None),
        ];
        for (i, &(cgroups, want)) in cases.iter().enumerate() {
            assert_eq!(cgroup_room(cgroups, &read), want, "case {i}: {cgroups:?}");
        }
    }
}
