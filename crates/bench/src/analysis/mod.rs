//! What the comparison concludes: crossovers and ratios between topology families.

pub mod crossover;
pub mod metric;
pub mod ratios;
