pub mod chat;
pub mod harmony;
pub mod stream;
pub mod tokenizer;
