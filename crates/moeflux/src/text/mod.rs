pub mod chat;
pub mod harmony;
pub mod stream;
pub mod template_budget;
mod template_consts;
pub mod tokenizer;
