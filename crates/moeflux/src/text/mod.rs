pub mod chat;
pub mod stream;
pub mod tokenizer;
