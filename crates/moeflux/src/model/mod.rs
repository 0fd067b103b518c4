//! Model families, written against the CPU backend ops.

pub mod attention;
pub mod deltanet;
pub mod experts;
pub mod moe;
pub mod qwen3_hybrid;
pub mod schema;
pub mod state;
pub mod timing;
pub mod weights;
