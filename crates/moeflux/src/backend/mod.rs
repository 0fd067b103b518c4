//! Compute backends. `cpu` runs everything on the host.

pub mod cpu;
pub mod cuda;
