//! `moeflux chat`: an interactive conversation. Each turn feeds only the
//! tokens the session does not hold yet (a checkpoint is taken at every turn
//! boundary), so earlier turns are not evaluated again.

use std::io::{BufRead, Read, Write};
use std::path::Path;
use std::sync::atomic::Ordering;

use anyhow::{bail, Context, Result};
use clap::Args;
use moeflux::generate::{generate, Event, FinishReason, GenerateOptions};
use moeflux::text::chat::{ChatMessage, Prompt, RenderOptions};

use crate::gen_args::{
    check_fits, interrupt_flag, load, DisplayArgs, Loaded, ModelArgs, SamplingArgs,
};
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
/// The most conversation JSON a chat file may hold (the snapshot after it
/// is bounded by the model and the context).
const MAX_CONVERSATION_BYTES: u64 = 64 << 20;
/// What the conversation is kept to when a turn fails.
const KEPT: &str = "the conversation is kept: /save it, /clear to start over, or go on";

pub fn run(args: ChatArgs) -> Result<()> {
    if args.model.dist_init.is_some() {
        // Every rank would need the same typed turns.
        anyhow::bail!("chat does not take --dist-init (use run, logits, bench or perplexity)");
    }
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
    let render_opts = RenderOptions {
        add_generation_prompt: true,
        enable_thinking: args.display.enable_thinking(),
        extra: args.display.template_extra(),
        ..Default::default()
    };
    eprintln!("{HELP}");
    let stdin = std::io::stdin();
    let mut raw = Vec::new();
    loop {
        eprint!("> ");
        let _ = std::io::stderr().flush();
        raw.clear();
        cancel.store(false, Ordering::SeqCst);
        if stdin.lock().read_until(b'\n', &mut raw)? == 0 {
            eprintln!();
            return Ok(());
        }
        // A line that is not UTF-8 is refused alone; the chat goes on.
        let Ok(line) = std::str::from_utf8(&raw) else {
            eprintln!("error: the input line is not valid UTF-8; it was ignored");
            continue;
        };
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
                "load" => load_chat(Path::new(arg), &mut loaded, &render_opts).map(|m| {
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

        // Nothing below ends the chat: a turn that cannot run is reported
        // and undone, and the conversation so far stays.
        messages.push(ChatMessage::new("user", input));
        let (rendered, prompt) = match prompt_for(&loaded, &messages, &render_opts) {
            Ok(p) => p,
            Err(e) => {
                messages.pop();
                eprintln!("error: {e:#}; {KEPT}");
                continue;
            }
        };
        if let Err(e) = check_fits(
            &loaded.session,
            prompt.len(),
            "the conversation with this message",
        ) {
            messages.pop();
            eprintln!("error: {e:#}; {KEPT}");
            continue;
        }
        let mut cfg = sampler.clone();
        cfg.seed = turn_seed;
        turn_seed = turn_seed.wrapping_add(1);
        let opts = GenerateOptions {
            starts_in_reasoning: rendered.text().trim_end().ends_with("<think>"),
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
            Err(e) => {
                messages.pop();
                eprintln!("error: {e}; {KEPT}");
                // A failed eval leaves the session unusable (and unsavable)
                // until it is rewound; the next turn re-evaluates what the
                // session no longer holds.
                let held = loaded.session.position();
                if loaded.session.truncate(held).is_err() {
                    loaded.session.clear();
                }
                continue;
            }
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
        if stats.finish == FinishReason::Length
            && loaded.session.position() >= loaded.session.max_context()
        {
            eprintln!(
                "(the context of {} tokens is full: /save the conversation, /clear to start over)",
                loaded.session.max_context()
            );
        }
        if args.display.timing {
            eprintln!("{}", timing_report(&stats, opts.sampler.seed));
        }
    }
}

/// The conversation rendered for generation, and its tokens (special-token
/// text typed in messages stays text).
fn prompt_for(
    loaded: &Loaded,
    messages: &[ChatMessage],
    opts: &RenderOptions,
) -> Result<(Prompt, Vec<u32>)> {
    let rendered = loaded
        .template
        .render_prompt(messages, opts, &loaded.tokenizer)?;
    let ids = loaded.tokenizer.encode_prompt(&rendered)?;
    Ok((rendered, ids))
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

/// `/load`: validates the whole file (its size first, then the
/// conversation against the chat template and the context, then the
/// snapshot) before touching the session.
fn load_chat(path: &Path, loaded: &mut Loaded, opts: &RenderOptions) -> Result<Vec<ChatMessage>> {
    if path.as_os_str().is_empty() {
        bail!("/load needs a file name");
    }
    let bad = |why: &str| anyhow::anyhow!("{}: not a moeflux chat file ({why})", path.display());
    let meta = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    if !meta.is_file() {
        bail!("{}: not a regular file", path.display());
    }
    let cap = 16 + MAX_CONVERSATION_BYTES + loaded.session.max_snapshot_len();
    if meta.len() > cap {
        return Err(bad(&format!(
            "{} bytes, more than a chat file of this model and context can be ({cap})",
            meta.len()
        )));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    std::fs::File::open(path)
        .and_then(|f| f.take(cap + 1).read_to_end(&mut bytes))
        .with_context(|| format!("reading {}", path.display()))?;
    if bytes.len() as u64 > cap {
        return Err(bad("it grew while being read"));
    }
    if bytes.len() < 16 || &bytes[..8] != CHAT_MAGIC {
        return Err(bad("no MFLXCHAT header"));
    }
    let n = u64::from_le_bytes(bytes[8..16].try_into().unwrap());
    if n > MAX_CONVERSATION_BYTES || n > (bytes.len() - 16) as u64 {
        return Err(bad(&format!(
            "conversation length {n} does not fit the file"
        )));
    }
    let n = n as usize;
    let messages: Vec<ChatMessage> = serde_json::from_slice(&bytes[16..16 + n])
        .with_context(|| format!("{}: conversation", path.display()))?;
    if !messages.is_empty() {
        let (_, prompt) = prompt_for(loaded, &messages, opts)
            .with_context(|| format!("{}: the conversation does not render", path.display()))?;
        check_fits(&loaded.session, prompt.len(), "its conversation")
            .with_context(|| format!("{}", path.display()))?;
    }
    loaded
        .session
        .state_load(&bytes[16 + n..])
        .with_context(|| format!("{}: session snapshot", path.display()))?;
    Ok(messages)
}
