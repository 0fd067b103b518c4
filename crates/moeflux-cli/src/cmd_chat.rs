//! `moeflux chat`: an interactive conversation. Each turn feeds only the
//! tokens the session does not hold yet (a checkpoint is taken at every turn
//! boundary), so earlier turns are not evaluated again.

use std::io::{BufRead, Write};
use std::path::Path;
use std::sync::atomic::Ordering;

use anyhow::{bail, Context, Result};
use clap::Args;
use moeflux::generate::{generate, Event, FinishReason, GenerateOptions};
use moeflux::text::chat::{ChatMessage, RenderOptions};

use crate::gen_args::{interrupt_flag, load, DisplayArgs, ModelArgs, SamplingArgs};
use crate::output::{stats_line, timing_report, TextPrinter};
use crate::progress::PrefillBar;

#[derive(Debug, Args)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// A system message that starts the conversation.
    #[arg(long)]
    pub system: Option<String>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub display: DisplayArgs,
}

const HELP: &str =
    "commands: /clear  /save FILE  /load FILE  /exit   (Ctrl-C stops an answer; Ctrl-D quits)";
const CHAT_MAGIC: &[u8; 8] = b"MFLXCHAT";

pub fn run(args: ChatArgs) -> Result<()> {
    let sampler = args.sampling.sampler(&args.model.dir()?)?;
    let mut loaded = load(&args.model)?;
    let cancel = interrupt_flag()?;
    let initial: Vec<ChatMessage> = args
        .system
        .iter()
        .map(|s| ChatMessage::new("system", s))
        .collect();
    let mut messages = initial.clone();
    let mut turn_seed = sampler.seed;
    eprintln!("{HELP}");
    let stdin = std::io::stdin();
    let mut line = String::new();
    loop {
        eprint!("> ");
        let _ = std::io::stderr().flush();
        line.clear();
        cancel.store(false, Ordering::SeqCst);
        if stdin.lock().read_line(&mut line)? == 0 {
            eprintln!();
            return Ok(());
        }
        let input = line.trim_end_matches(['\n', '\r']);
        if input.trim().is_empty() {
            continue;
        }
        if let Some(cmd) = input.strip_prefix('/') {
            let (name, arg) = cmd
                .split_once(' ')
                .map_or((cmd, ""), |(a, b)| (a, b.trim()));
            let result = match name {
                "exit" | "quit" => return Ok(()),
                "clear" => {
                    loaded.session.clear();
                    messages = initial.clone();
                    eprintln!("(conversation cleared)");
                    Ok(())
                }
                "save" => save(Path::new(arg), &loaded.session, &messages)
                    .map(|()| eprintln!("(saved {} tokens to {arg})", loaded.session.position())),
                "load" => load_chat(Path::new(arg), &mut loaded.session).map(|m| {
                    messages = m;
                    eprintln!(
                        "(loaded {} tokens, {} messages)",
                        loaded.session.position(),
                        messages.len()
                    );
                }),
                "help" => {
                    eprintln!("{HELP}");
                    Ok(())
                }
                _ => Err(anyhow::anyhow!("unknown command /{name}; {HELP}")),
            };
            if let Err(e) = result {
                eprintln!("error: {e:#}");
            }
            continue;
        }

        messages.push(ChatMessage::new("user", input));
        let rendered = loaded.template.render(
            &messages,
            &RenderOptions {
                add_generation_prompt: true,
                enable_thinking: args.display.enable_thinking(),
                ..Default::default()
            },
        )?;
        let prompt = loaded.tokenizer.encode(&rendered, false)?;
        let mut cfg = sampler.clone();
        cfg.seed = turn_seed;
        turn_seed = turn_seed.wrapping_add(1);
        let opts = GenerateOptions {
            starts_in_reasoning: rendered.trim_end().ends_with("<think>"),
            checkpoint_after_prefill: true,
            ..args.sampling.generate_options(cfg)
        };
        let mut printer = TextPrinter::new(args.display.hide_reasoning);
        let mut bar = PrefillBar::new();
        let (mut content, mut reasoning) = (String::new(), String::new());
        let stats = generate(
            &mut loaded.session,
            &loaded.tokenizer,
            &prompt,
            &opts,
            Some(&cancel),
            &mut |e| match e {
                Event::Prefill { done, total } => bar.update(done, total),
                Event::Text { text, reasoning: r } => {
                    if r {
                        reasoning.push_str(text);
                    } else {
                        content.push_str(text);
                    }
                    printer.text(text, r);
                }
            },
        );
        printer.end();
        let stats = match stats {
            Ok(s) => s,
            Err(moeflux::Error::Cancelled) => {
                messages.pop();
                eprintln!("(stopped)");
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        if stats.finish == FinishReason::Cancelled {
            eprintln!("(stopped)");
        }
        let mut reply = ChatMessage::new("assistant", content.trim());
        if !reasoning.trim().is_empty() {
            reply.reasoning_content = Some(reasoning.trim().to_string());
        }
        messages.push(reply);
        eprintln!("{}", stats_line(None, &stats));
        if args.display.timing {
            eprintln!("{}", timing_report(&stats, opts.sampler.seed));
        }
    }
}

/// `/save`: the conversation (JSON) and the session snapshot, in one file
/// written atomically.
fn save(path: &Path, session: &moeflux::Session, messages: &[ChatMessage]) -> Result<()> {
    if path.as_os_str().is_empty() {
        bail!("/save needs a file name");
    }
    let json = serde_json::to_vec(messages)?;
    let snap = session.state_save()?;
    moeflux::fsutil::write_file_atomic(path, |w| {
        w.write_all(CHAT_MAGIC)?;
        w.write_all(&(json.len() as u64).to_le_bytes())?;
        w.write_all(&json)?;
        w.write_all(&snap)
    })?;
    Ok(())
}

/// `/load`: validates the whole file before touching the session.
fn load_chat(path: &Path, session: &mut moeflux::Session) -> Result<Vec<ChatMessage>> {
    if path.as_os_str().is_empty() {
        bail!("/load needs a file name");
    }
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let bad = || anyhow::anyhow!("{}: not a moeflux chat file", path.display());
    if bytes.len() < 16 || &bytes[..8] != CHAT_MAGIC {
        return Err(bad());
    }
    let n = u64::from_le_bytes(bytes[8..16].try_into().unwrap()) as usize;
    let json = bytes
        .get(16..16usize.checked_add(n).ok_or_else(bad)?)
        .ok_or_else(bad)?;
    let messages: Vec<ChatMessage> = serde_json::from_slice(json)
        .with_context(|| format!("{}: conversation", path.display()))?;
    session
        .state_load(&bytes[16 + n..])
        .with_context(|| format!("{}: session snapshot", path.display()))?;
    Ok(messages)
}
