//! `moeflux tokenize`: text to token ids and back with a model directory's
//! tokenizer. Reads only the tokenizer files, never the weights.

use std::io::{Read, Write};

use anyhow::{bail, Context, Result};
use clap::Args;
use moeflux::text::tokenizer::Tokenizer;

use crate::model_ref::ModelRef;

#[derive(Debug, Args)]
pub struct TokenizeArgs {
    /// Model directory (only tokenizer.json is needed; generation_config.json,
    /// config.json and tokenizer_config.json are read when present), or
    /// `hf:ORG/NAME[@REV][:QUANT]` (see `moeflux pull`).
    #[arg(long, value_parser = crate::model_ref::parse)]
    pub model: ModelRef,
    /// Text to encode (`-` reads standard input). Special tokens such as
    /// <|im_start|> written in it become their ids.
    #[arg(required_unless_present = "decode", conflicts_with = "decode")]
    pub text: Option<String>,
    /// Decode these token ids instead: comma- or space-separated, or a JSON
    /// array (what `--json` prints).
    #[arg(long, value_name = "IDS", allow_hyphen_values = true)]
    pub decode: Option<String>,
    /// Print JSON: the ids as an array, or the decoded text as a string.
    #[arg(long)]
    pub json: bool,
    /// Encode: apply the tokenizer's post-processor (adds BOS where the
    /// tokenizer does; the Qwen tokenizers add nothing).
    #[arg(long)]
    pub add_special_tokens: bool,
    /// Decode: leave special tokens out of the text.
    #[arg(long)]
    pub skip_special: bool,
}

/// Token ids from "1,2,3", "1 2 3" or "[1, 2, 3]".
pub fn parse_ids(s: &str) -> Result<Vec<u32>> {
    let t = s.trim();
    let t = t
        .strip_prefix('[')
        .and_then(|r| r.strip_suffix(']'))
        .unwrap_or(t);
    t.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|p| !p.is_empty())
        .enumerate()
        .map(|(i, p)| {
            p.parse::<u32>()
                .with_context(|| format!("--decode: item {} (`{p}`) is not a token id", i + 1))
        })
        .collect()
}

pub fn run(args: TokenizeArgs) -> Result<()> {
    let dir = args.model.dir()?;
    let tokenizer = Tokenizer::from_model_dir(dir)
        .with_context(|| format!("loading the tokenizer of {}", dir.display()))?;
    let mut stdout = std::io::stdout().lock();
    if let Some(list) = &args.decode {
        let ids = parse_ids(list)?;
        let text = tokenizer
            .decode(&ids, args.skip_special)
            .context("--decode")?;
        if args.json {
            writeln!(stdout, "{}", serde_json::to_string(&text)?)?;
        } else {
            writeln!(stdout, "{text}")?;
        }
    } else {
        let text = match args.text.as_deref() {
            Some("-") => {
                let mut s = String::new();
                std::io::stdin()
                    .read_to_string(&mut s)
                    .context("reading the text from standard input")?;
                s
            }
            Some(t) => t.to_string(),
            None => bail!("no text given (or use --decode IDS)"),
        };
        let ids = tokenizer.encode(&text, args.add_special_tokens)?;
        if args.json {
            writeln!(stdout, "{}", serde_json::to_string(&ids)?)?;
        } else {
            let line: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
            writeln!(stdout, "{}", line.join(","))?;
        }
    }
    stdout.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_in_every_spelling() {
        assert_eq!(parse_ids("1,2,3").unwrap(), [1, 2, 3]);
        assert_eq!(parse_ids(" [1, 2,\n3] ").unwrap(), [1, 2, 3]);
        assert_eq!(parse_ids("4 5").unwrap(), [4, 5]);
        assert!(parse_ids("").unwrap().is_empty());
        let e = parse_ids("1,x").unwrap_err().to_string();
        assert_eq!(e, "--decode: item 2 (`x`) is not a token id");
        assert!(parse_ids("-1").is_err());
        assert!(parse_ids("4294967296").is_err());
    }
}
