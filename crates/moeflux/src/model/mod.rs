//! Model families, written against the CPU backend ops.

pub mod schema;
