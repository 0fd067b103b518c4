pub mod chat;
pub mod harmony;
pub mod stream;
pub mod template_budget;
mod template_consts;
mod token_bytes;
pub mod tokenizer;
