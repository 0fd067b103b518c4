//! `moeflux run`: one prompt in, generated text streamed to stdout.

use anyhow::{bail, Result};
use clap::Args;
use moeflux::generate::{generate, Event, FinishReason, GenerateOptions};
use moeflux::text::chat::{ChatMessage, RenderOptions};

use crate::cmd_logits::parse_tokens;
use crate::gen_args::{check_fits, interrupt_flag, load, DisplayArgs, ModelArgs, SamplingArgs};
use crate::output::{stats_line, timing_report, TextPrinter};
use crate::progress::PrefillBar;

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt (a user message, formatted with the model's chat template).
    #[arg(long, short = 'p', required_unless_present = "prompt_ids")]
    pub prompt: Option<String>,
    /// A system message to put before the prompt.
    #[arg(long)]
    pub system: Option<String>,
    /// Feed the prompt text as is, without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// Start from these token ids instead of a text prompt (debugging).
    #[arg(long, conflicts_with = "prompt")]
    pub prompt_ids: Option<String>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub display: DisplayArgs,
}

pub fn run(args: RunArgs) -> Result<()> {
    let sampler = args.sampling.sampler(&args.model.dir()?)?;
    let mut loaded = load(&args.model)?;
    let sampler = args.sampling.shared_seed(sampler, &loaded.session);
    let (prompt_ids, starts_in_reasoning) = match (&args.prompt_ids, &args.prompt) {
        (Some(ids), _) => (parse_tokens("--prompt-ids", ids)?, false),
        (None, Some(text)) if args.raw => (loaded.tokenizer.encode(text, true)?, false),
        (None, Some(text)) => {
            let mut messages = Vec::new();
            if let Some(s) = &args.system {
                messages.push(ChatMessage::new("system", s));
            }
            messages.push(ChatMessage::new("user", text));
            let rendered = loaded.template.render_prompt(
                &messages,
                &RenderOptions {
                    add_generation_prompt: true,
                    enable_thinking: args.display.enable_thinking(),
                    extra: args.display.template_extra(),
                    ..Default::default()
                },
                &loaded.tokenizer,
            )?;
            let open = rendered.text().trim_end().ends_with("<think>");
            (loaded.tokenizer.encode_prompt(&rendered)?, open)
        }
        (None, None) => bail!("give --prompt or --prompt-ids"),
    };
    check_fits(&loaded.session, prompt_ids.len(), "the prompt")?;
    let opts = GenerateOptions {
        starts_in_reasoning,
        ..args.sampling.generate_options(sampler.clone())
    };
    let cancel = interrupt_flag()?;
    let mut printer = TextPrinter::new(args.display.hide_reasoning);
    let mut bar = PrefillBar::new();
    let stats = generate(
        &mut loaded.session,
        &loaded.tokenizer,
        &prompt_ids,
        &opts,
        Some(&cancel),
        &mut |e| match e {
            Event::Prefill { done, total } => bar.update(done, total),
            Event::Text { text, reasoning } => printer.text(text, reasoning),
        },
    )?;
    printer.end();
    eprintln!("{}", stats_line(Some(loaded.load_time), &stats));
    if args.display.timing {
        eprintln!("{}", timing_report(&stats, sampler.seed));
    }
    if stats.finish == FinishReason::Cancelled {
        return Err(moeflux::Error::Cancelled.into());
    }
    Ok(())
}
