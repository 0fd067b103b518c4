//! OpenAI's harmony format (gpt-oss): which generated text is reasoning,
//! which is the answer and which is a tool call.
//!
//! A harmony answer is a run of messages, each `<|start|>` (the role,
//! `assistant`, written by the prompt for the first one) + a header +
//! `<|message|>` + the body + `<|end|>`; the last one ends with `<|return|>`
//! (an answer) or `<|call|>` (a tool call), both of which end generation.
//! The header names the channel (`<|channel|>analysis`, `final`,
//! `commentary`), maybe a recipient (`to=functions.NAME`, before or after
//! the channel) and a content type (`<|constrain|>json`, or `json` alone):
//!
//! ```text
//! <|channel|>analysis<|message|>The user asks ...<|end|>
//! <|start|>assistant<|channel|>final<|message|>Paris.<|return|>
//! <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>
//! ```
//!
//! The markers are special tokens, read here token by token ([`Channels`]
//! is fed by the generation's `Decoder`): the `analysis` body is reasoning,
//! a message with a recipient is a tool call, any other body is the
//! answer, and headers are never shown. A tool call is passed on as text in
//! one spelling, [`call_opening`] + the body + [`CALL`], for the server's
//! tool-call parser; everything else loses its markup.

use crate::error::Result;
use crate::text::tokenizer::Tokenizer;

pub const START: &str = "<|start|>";
pub const CHANNEL: &str = "<|channel|>";
pub const CONSTRAIN: &str = "<|constrain|>";
pub const MESSAGE: &str = "<|message|>";
pub const END: &str = "<|end|>";
pub const RETURN: &str = "<|return|>";
pub const CALL: &str = "<|call|>";

/// Header text kept at most while waiting for `<|message|>`: a real header
/// is a few words; past this the text is shown as the answer (a model that
/// writes no `<|message|>` would otherwise say nothing at all).
pub const MAX_HEADER: usize = 256;

/// A harmony marker token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Marker {
    Start,
    Channel,
    Constrain,
    Message,
    End,
    Return,
    Call,
}

impl Marker {
    pub fn text(self) -> &'static str {
        match self {
            Marker::Start => START,
            Marker::Channel => CHANNEL,
            Marker::Constrain => CONSTRAIN,
            Marker::Message => MESSAGE,
            Marker::End => END,
            Marker::Return => RETURN,
            Marker::Call => CALL,
        }
    }
}

const MARKERS: [Marker; 7] = [
    Marker::Start,
    Marker::Channel,
    Marker::Constrain,
    Marker::Message,
    Marker::End,
    Marker::Return,
    Marker::Call,
];

/// The ids of a vocabulary's harmony markers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HarmonyIds {
    ids: Vec<(u32, Marker)>,
}

impl HarmonyIds {
    /// The markers of `tokenizer`, when it has `<|start|>`, `<|channel|>`,
    /// `<|message|>` and `<|end|>` as special tokens (the others are
    /// optional).
    pub fn from_tokenizer(tokenizer: &Tokenizer) -> Option<Self> {
        let ids: Vec<(u32, Marker)> = MARKERS
            .iter()
            .filter_map(|&m| {
                let id = tokenizer.token_to_id(m.text())?;
                tokenizer.is_special(id).then_some((id, m))
            })
            .collect();
        let has = |m: Marker| ids.iter().any(|&(_, x)| x == m);
        [Marker::Start, Marker::Channel, Marker::Message, Marker::End]
            .into_iter()
            .all(has)
            .then_some(HarmonyIds { ids })
    }

    pub fn marker(&self, id: u32) -> Option<Marker> {
        self.ids.iter().find(|&&(i, _)| i == id).map(|&(_, m)| m)
    }
}

/// What the text of ordinary tokens is at a point of the output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    /// A header (hidden).
    Header,
    /// An `analysis` body.
    Reasoning,
    /// A `final` body, a `commentary` body without a recipient, or text
    /// outside any message.
    Content,
    /// The body of a message with a recipient: a tool call's arguments.
    Call,
}

/// Text to show, and whether it is reasoning.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Shown {
    pub text: String,
    pub reasoning: bool,
}

/// What a marker did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Transition {
    /// Tool-call markup to pass on (never reasoning).
    pub text: String,
    /// `<|return|>` or `<|call|>`: the answer is over.
    pub ends: bool,
}

/// Where a harmony answer is, fed its tokens' text and markers.
#[derive(Debug, Clone)]
pub struct Channels {
    part: Part,
    header: String,
}

impl Default for Channels {
    fn default() -> Self {
        Self::new()
    }
}

impl Channels {
    /// Outside any message: text is the answer until a marker says
    /// otherwise ([`prime`](Self::prime) with the prompt first).
    pub fn new() -> Self {
        Channels {
            part: Part::Content,
            header: String::new(),
        }
    }

    pub fn part(&self) -> &Part {
        &self.part
    }

    pub fn in_reasoning(&self) -> bool {
        self.part == Part::Reasoning
    }

    /// Ordinary tokens' text: what to show of it.
    pub fn text(&mut self, s: &str) -> Shown {
        match self.part {
            Part::Header => {
                self.header.push_str(s);
                if self.header.len() <= MAX_HEADER {
                    return Shown::default();
                }
                // Not a header after all: show it.
                self.part = Part::Content;
                Shown {
                    text: std::mem::take(&mut self.header),
                    reasoning: false,
                }
            }
            ref p => Shown {
                text: s.to_string(),
                reasoning: *p == Part::Reasoning,
            },
        }
    }

    /// A marker token.
    pub fn marker(&mut self, m: Marker) -> Transition {
        let mut t = Transition::default();
        match m {
            Marker::Start => {
                t.text = self.leave_body();
                self.part = Part::Header;
                self.header.clear();
            }
            Marker::Channel => {
                if self.part != Part::Header {
                    t.text = self.leave_body();
                    self.part = Part::Header;
                    self.header.clear();
                }
                self.header.push_str(CHANNEL);
            }
            Marker::Constrain => {
                if self.part == Part::Header {
                    self.header.push_str(CONSTRAIN);
                }
            }
            Marker::Message => {
                if self.part == Part::Header {
                    let header = std::mem::take(&mut self.header);
                    let (channel, recipient) = parse_header(&header);
                    self.part = match recipient {
                        Some(r) => {
                            t.text = call_opening(channel.unwrap_or("commentary"), r);
                            Part::Call
                        }
                        None if channel == Some("analysis") => Part::Reasoning,
                        None => Part::Content,
                    };
                }
            }
            Marker::End | Marker::Return | Marker::Call => {
                t.text = self.leave_body();
                self.part = Part::Content;
                t.ends = m != Marker::End;
            }
        }
        t
    }

    /// Runs the prompt's last message (from its last `<|start|>`) through,
    /// showing nothing: the answer starts where the prompt leaves off (a
    /// header after `<|start|>assistant`, or inside a body the prompt
    /// opened, such as a forced tool call).
    pub fn prime(&mut self, ids: &HarmonyIds, tokenizer: &Tokenizer, prompt: &[u32]) -> Result<()> {
        let Some(from) = prompt
            .iter()
            .rposition(|&t| ids.marker(t) == Some(Marker::Start))
        else {
            return Ok(());
        };
        let mut run: Vec<u32> = Vec::new();
        for &tok in &prompt[from..] {
            match ids.marker(tok) {
                Some(m) => {
                    self.text(&tokenizer.decode(&run, true)?);
                    run.clear();
                    self.marker(m);
                }
                None => run.push(tok),
            }
        }
        self.text(&tokenizer.decode(&run, true)?);
        Ok(())
    }

    /// Leaving a body: a tool call is closed.
    fn leave_body(&mut self) -> String {
        if self.part == Part::Call {
            CALL.to_string()
        } else {
            String::new()
        }
    }
}

/// The text a tool call is passed on with, before its arguments.
pub fn call_opening(channel: &str, recipient: &str) -> String {
    format!("{CHANNEL}{channel} to={recipient}{MESSAGE}")
}

/// A header's channel and recipient (`to=...`, not `to=assistant`).
/// Markers separate words like spaces.
pub fn parse_header(header: &str) -> (Option<&str>, Option<&str>) {
    let word_end = |s: &str| {
        s.find(|c: char| c.is_whitespace() || c == '<')
            .unwrap_or(s.len())
    };
    let channel = header.rfind(CHANNEL).map(|i| {
        let s = header[i + CHANNEL.len()..].trim_start();
        &s[..word_end(s)]
    });
    let recipient = header
        .match_indices("to=")
        .filter(|&(i, _)| {
            // `to=` starts a word.
            header[..i]
                .chars()
                .next_back()
                .is_none_or(|c| c.is_whitespace() || c == '>')
        })
        .map(|(i, _)| {
            let s = &header[i + 3..];
            &s[..word_end(s)]
        })
        .find(|r| !r.is_empty() && *r != "assistant");
    (channel.filter(|c| !c.is_empty()), recipient)
}
