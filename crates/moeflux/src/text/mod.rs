pub mod chat;
pub mod harmony;
pub mod stream;
pub mod template_budget;
pub mod tokenizer;
