//! Chat templates run on a budget: a template comes with the model, so a
//! stranger's model directory must not be able to exhaust memory or time.
//!
//! - **Fuel**: MiniJinja's instruction budget ([`TemplateBudget::fuel`]).
//! - **Bytes**: everything a render writes (its output, and what it
//!   captures with `{% set x %}...{% endset %}` or macro calls) is counted
//!   as it is written, and every string a template builds (`~`, `+`, `*`,
//!   and the result of every filter, function and method call) is checked
//!   against [`TemplateBudget::max_bytes`]; sequences against an item cap
//!   (`max_bytes / 16`). Operators that can grow their input many times
//!   over (`*`, and the filters and methods `join`, `replace`, `indent`,
//!   `format`, `slice`, `string`, `pprint`) are checked *before* they run;
//!   `~` and `+` at most double what is already bounded. The bytes all
//!   these build add up to at most [`TemplateBudget::max_built`], which
//!   bounds the time a render spends copying.
//!
//! MiniJinja folds constant expressions when it compiles
//! (`{{ [0] * 10000 * 10000 }}`), before any of these checks can run: the
//! repetitions it would fold are sized first
//! ([`template_consts`](super::template_consts)).
//!
//! Fuel alone does not bound memory: it counts instructions, and one
//! instruction (`{% set s = s ~ s %}`) can double a string. MiniJinja has no
//! hook on its operators, so the compiled instructions are rewritten
//! ([`compile`]): raw template text becomes a constant emitted through the
//! formatter (which counts), and each of `~`, `+`, `*` is preceded by a call
//! of a check function that hands its operands back unchanged
//! (`CallFunction(check, 2)`, `UnpackList(2)`), so the operators keep
//! MiniJinja's own semantics. The names of the check functions are not
//! identifiers, so a template cannot call or shadow them.

use std::cell::RefCell;
use std::fmt::{self, Write};
use std::sync::Arc;

use minijinja::machinery::{CompiledTemplate, Instruction, Instructions, TemplateConfig};
use minijinja::value::Rest;
use minijinja::{AutoEscape, Environment, ErrorKind, Output, State, Value};

type JResult<T> = std::result::Result<T, minijinja::Error>;

/// How much a chat template may do in one render.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TemplateBudget {
    /// MiniJinja instructions per render.
    pub fuel: u64,
    /// The most bytes a render may write (output and captures together),
    /// and the longest string it may build.
    pub max_bytes: usize,
}

impl TemplateBudget {
    /// Bytes of prompt per token of context. A prompt longer than the
    /// context in tokens cannot be evaluated anyway; tokens average 3 to 5
    /// bytes of text, and 32 leaves room for prompts of long tokens
    /// (whitespace runs, CJK, markup) without letting a template build
    /// gigabytes.
    pub const BYTES_PER_TOKEN: usize = 32;
    /// The byte cap of small contexts.
    pub const MIN_BYTES: usize = 1 << 20;
    /// Instructions per token of context: the real templates of
    /// tests/fixtures/templates spend 0.3 to 0.72 per byte of prompt on a
    /// 500-turn conversation (fewer than 1, which
    /// `chat_template::real_templates_fit_the_budget` checks), and a token
    /// is a few bytes.
    pub const FUEL_PER_TOKEN: u64 = 64;
    /// The fuel of small contexts (about 0.1 s of rendering).
    pub const MIN_FUEL: u64 = 2_000_000;
    /// Bytes built in all, as a multiple of `max_bytes`: templates that
    /// build a string piece by piece copy it again per piece.
    pub const BUILT_FACTOR: usize = 64;

    /// The budget for a context window of `tokens` tokens.
    pub fn for_context(tokens: usize) -> Self {
        TemplateBudget {
            fuel: (tokens as u64)
                .saturating_mul(Self::FUEL_PER_TOKEN)
                .max(Self::MIN_FUEL),
            max_bytes: tokens
                .saturating_mul(Self::BYTES_PER_TOKEN)
                .max(Self::MIN_BYTES),
        }
    }

    /// Instructions per message rendered, on top of the context's fuel:
    /// the real templates spend under 100 per plain message (a request
    /// may hold one message per token of context).
    pub const FUEL_PER_MESSAGE: u64 = 1024;

    /// How many times its input a render may write: templates pass a
    /// message's content through a macro or a `{% set %}` block before
    /// printing it (Qwen3.5's writes it about three times in all).
    pub const INPUT_FACTOR: usize = 8;

    /// This budget widened for one render's input: the prompt carries its
    /// conversation, so the byte cap is never below
    /// [`INPUT_FACTOR`](Self::INPUT_FACTOR) times the input's size (its
    /// messages, tools and variables as JSON), and the fuel grows with the
    /// message count. An input too long for the context is then refused
    /// for its length, not blamed on the template.
    pub fn for_input(self, bytes: usize, messages: usize) -> Self {
        TemplateBudget {
            fuel: self
                .fuel
                .saturating_add((messages as u64).saturating_mul(Self::FUEL_PER_MESSAGE)),
            max_bytes: self.max_bytes.max(bytes.saturating_mul(Self::INPUT_FACTOR)),
        }
    }

    /// The most items of a sequence a template may build.
    pub fn max_items(&self) -> usize {
        self.max_bytes / 16
    }

    /// The most bytes a render may build in all (strings built by
    /// operators and calls, added up).
    pub fn max_built(&self) -> usize {
        self.max_bytes.saturating_mul(Self::BUILT_FACTOR)
    }
}

impl Default for TemplateBudget {
    /// The budget of a 128K-token context.
    fn default() -> Self {
        Self::for_context(1 << 17)
    }
}

/// What the current render has spent (one render per thread at a time).
struct Meter {
    budget: TemplateBudget,
    written: usize,
    built: usize,
    exceeded: Option<String>,
}

thread_local! {
    static METER: RefCell<Option<Meter>> = const { RefCell::new(None) };
}

fn budget() -> TemplateBudget {
    METER.with(|m| m.borrow().as_ref().map(|m| m.budget).unwrap_or_default())
}

/// A budget error; the message is kept for [`Render::finish`].
fn exceeded(msg: String) -> minijinja::Error {
    METER.with(|m| {
        if let Some(m) = m.borrow_mut().as_mut() {
            m.exceeded.get_or_insert_with(|| msg.clone());
        }
    });
    minijinja::Error::new(ErrorKind::InvalidOperation, msg)
}

/// Counts `bytes` as built by the template.
fn built(bytes: usize) -> JResult<()> {
    let b = budget();
    if bytes > b.max_bytes {
        return Err(exceeded(format!(
            "a string of {bytes} bytes, more than the {} allowed",
            b.max_bytes
        )));
    }
    let total = METER.with(|m| {
        let mut m = m.borrow_mut();
        let m = m.as_mut()?;
        m.built = m.built.saturating_add(bytes);
        Some(m.built)
    });
    match total {
        Some(t) if t > b.max_built() => Err(exceeded(format!(
            "more than {} bytes of strings built in one render",
            b.max_built()
        ))),
        _ => Ok(()),
    }
}

fn items(n: usize) -> JResult<()> {
    let b = budget();
    if n > b.max_items() {
        return Err(exceeded(format!(
            "a sequence of {n} items, more than the {} allowed",
            b.max_items()
        )));
    }
    built(n.saturating_mul(std::mem::size_of::<Value>()))
}

/// A writer that refuses to take more than `left` bytes.
struct Limited<W> {
    inner: W,
    left: usize,
    over: bool,
}

impl<W: Write> Write for Limited<W> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        if s.len() > self.left {
            self.over = true;
            return Err(fmt::Error);
        }
        self.left -= s.len();
        self.inner.write_str(s)
    }
}

struct Sink;

impl Write for Sink {
    fn write_str(&mut self, _: &str) -> fmt::Result {
        Ok(())
    }
}

/// The length of `v` as text, if at most `limit` (without building it: a
/// list can hold one long string many times).
fn text_len(v: &Value, limit: usize) -> Option<usize> {
    if let Some(s) = v.as_str() {
        return (s.len() <= limit).then_some(s.len());
    }
    let mut w = Limited {
        inner: Sink,
        left: limit,
        over: false,
    };
    write!(w, "{v}").ok()?;
    Some(limit - w.left)
}

/// `text_len` or a budget error.
fn text_len_within(v: &Value, limit: usize) -> JResult<usize> {
    text_len(v, limit).ok_or_else(|| {
        exceeded(format!(
            "a value longer than {limit} bytes as text (the budget's {})",
            budget().max_bytes
        ))
    })
}

/// `v` as text, built within the budget.
fn bounded_text(v: &Value, debug: bool) -> JResult<String> {
    let max = budget().max_bytes;
    let mut w = Limited {
        inner: String::new(),
        left: max,
        over: false,
    };
    let r = if debug {
        write!(w, "{v:#?}")
    } else {
        write!(w, "{v}")
    };
    match r {
        Ok(()) => {
            built(w.inner.len())?;
            Ok(w.inner)
        }
        Err(_) => Err(exceeded(format!("a value longer than {max} bytes as text"))),
    }
}

// The check functions' names: not identifiers, so no template can reach them.
const CHECK_CAT: &str = "moeflux budget ~";
const CHECK_ADD: &str = "moeflux budget +";
const CHECK_MUL: &str = "moeflux budget *";
const CHECK_VALUE: &str = "moeflux budget value";

/// Compiles `source` with its `~`, `+`, `*`, raw text and call results
/// routed through the budget checks (see the module docs).
pub(crate) fn compile<'s>(
    name: &'s str,
    source: &'s str,
    syntax: minijinja::syntax::SyntaxConfig,
) -> JResult<CompiledTemplate<'s>> {
    super::template_consts::check(name, source, syntax.clone(), max_bytes()).map_err(exceeded)?;
    let config = TemplateConfig {
        syntax_config: syntax,
        default_auto_escape: Arc::new(|_: &str| AutoEscape::None),
    };
    let mut t = CompiledTemplate::new(name, source, &config)?;
    t.instructions = rewrite(&t.instructions);
    for block in t.blocks.values_mut() {
        *block = rewrite(block);
    }
    Ok(t)
}

/// The instructions that replace `ins`, its jump targets mapped by `target`.
fn expand<'s>(ins: &Instruction<'s>, target: impl Fn(u32) -> u32) -> Vec<Instruction<'s>> {
    use Instruction as I;
    let checked = |check: &'static str, op: I<'s>| {
        vec![I::CallFunction(check, Some(2)), I::UnpackList(2), op]
    };
    match ins {
        I::EmitRaw(s) => vec![I::LoadConst(Value::from(*s)), I::Emit],
        I::StringConcat => checked(CHECK_CAT, I::StringConcat),
        I::Add => checked(CHECK_ADD, I::Add),
        I::Mul => checked(CHECK_MUL, I::Mul),
        I::ApplyFilter(..) | I::CallMethod(..) | I::CallFunction(..) | I::CallObject(..) => {
            vec![ins.clone(), I::CallFunction(CHECK_VALUE, Some(1))]
        }
        I::Jump(t) => vec![I::Jump(target(*t))],
        I::JumpIfFalse(t) => vec![I::JumpIfFalse(target(*t))],
        I::JumpIfFalseOrPop(t) => vec![I::JumpIfFalseOrPop(target(*t))],
        I::JumpIfTrueOrPop(t) => vec![I::JumpIfTrueOrPop(target(*t))],
        I::Iterate(t) => vec![I::Iterate(target(*t))],
        I::BuildMacro(name, t, flags) => vec![I::BuildMacro(name, target(*t), *flags)],
        other => vec![other.clone()],
    }
}

fn rewrite<'s>(old: &Instructions<'s>) -> Instructions<'s> {
    let n = (0u32..).take_while(|&i| old.get(i).is_some()).count() as u32;
    // Where each old instruction starts in the new stream (and the end).
    let mut start = Vec::with_capacity(n as usize + 1);
    let mut at = 0u32;
    for i in 0..n {
        start.push(at);
        at += expand(old.get(i).expect("in range"), |t| t).len() as u32;
    }
    start.push(at);
    let target = |t: u32| start.get(t as usize).copied().unwrap_or(at);
    let mut new = Instructions::new(old.name(), old.source());
    for i in 0..n {
        for ins in expand(old.get(i).expect("in range"), target) {
            match (old.get_span(i), old.get_line(i)) {
                (Some(span), _) => new.add_with_span(ins, span),
                (None, Some(line)) => new.add_with_line(ins, line as u16),
                (None, None) => new.add(ins),
            };
        }
    }
    new
}

/// Operands handed back for `UnpackList(2)`, which pushes them reversed.
fn operands(a: Value, b: Value) -> Value {
    Value::from(vec![b, a])
}

fn check_cat(a: Value, b: Value) -> JResult<Value> {
    let max = budget().max_bytes;
    let la = text_len_within(&a, max)?;
    let lb = text_len_within(&b, max - la)?;
    built(la + lb)?;
    Ok(operands(a, b))
}

fn check_add(a: Value, b: Value) -> JResult<Value> {
    if let (Some(x), Some(y)) = (a.as_str(), b.as_str()) {
        built(x.len().saturating_add(y.len()))?;
    } else if let (Some(x), Some(y)) = (seq_len(&a), seq_len(&b)) {
        items(x.saturating_add(y))?;
    }
    Ok(operands(a, b))
}

fn check_mul(a: Value, b: Value) -> JResult<Value> {
    let (v, n) = if a.as_i64().is_some() {
        (&b, &a)
    } else {
        (&a, &b)
    };
    let times = n.as_i64().map_or(0, |n| n.max(0) as u64) as usize;
    if let Some(s) = v.as_str() {
        built(s.len().saturating_mul(times))?;
    } else if let Some(len) = seq_len(v) {
        items(len.saturating_mul(times))?;
    }
    Ok(operands(a, b))
}

fn seq_len(v: &Value) -> Option<usize> {
    use minijinja::value::ValueKind;
    matches!(v.kind(), ValueKind::Seq | ValueKind::Iterable)
        .then(|| v.len())
        .flatten()
}

/// The result of a call, checked after the fact.
fn check_value(v: Value) -> JResult<Value> {
    if let Some(s) = v.as_str() {
        built(s.len())?;
    } else if let Some(n) = seq_len(&v) {
        items(n)?;
    }
    Ok(v)
}

/// The formatter: writes a value's text, counting it against the budget.
fn format_counted(out: &mut Output, _state: &mut State, value: &Value) -> JResult<()> {
    let max = budget().max_bytes;
    let written = METER.with(|m| m.borrow().as_ref().map_or(0, |m| m.written));
    let mut w = Limited {
        inner: out,
        left: max.saturating_sub(written),
        over: false,
    };
    let r = write!(w, "{value}");
    let now = max - w.left;
    METER.with(|m| {
        if let Some(m) = m.borrow_mut().as_mut() {
            m.written = now;
        }
    });
    match r {
        Ok(()) => Ok(()),
        Err(_) if w.over => Err(exceeded(format!(
            "the prompt (with what the template captures) is longer than {max} bytes"
        ))),
        Err(e) => Err(minijinja::Error::new(
            ErrorKind::WriteFailure,
            e.to_string(),
        )),
    }
}

/// Numbers among a call's arguments (positional or keyword) and the
/// lengths of its string arguments: the widths a filter may repeat.
fn widths(args: &[Value]) -> usize {
    let mut w = 0usize;
    let mut see = |v: &Value| {
        if let Some(n) = v.as_i64() {
            w = w.max(n.max(0) as usize);
        } else if let Some(s) = v.as_str() {
            w = w.max(s.len());
        }
    };
    for a in args {
        if a.is_kwargs() {
            for k in a.try_iter().into_iter().flatten() {
                if let Ok(v) = a.get_item(&k) {
                    see(&v);
                }
            }
        } else {
            see(a);
        }
    }
    w
}

/// The numbers written in a format string (`%10s`, `{:>10}`), added up: the
/// padding it may ask for.
fn format_padding(fmt: &str) -> usize {
    fmt.split(|c: char| !c.is_ascii_digit())
        .filter(|d| !d.is_empty())
        .map(|d| d.parse::<usize>().unwrap_or(usize::MAX))
        .fold(0usize, usize::saturating_add)
}

/// Refuses `fmt.format(args)` / `fmt|format(args)` that could outgrow the
/// budget.
fn precheck_format(fmt: &str, args: &[Value]) -> JResult<()> {
    let max = budget().max_bytes;
    let mut total = fmt.len().saturating_add(format_padding(fmt));
    for a in args {
        total = total.saturating_add(text_len_within(a, max)?);
    }
    built(total)
}

/// Refuses `s.replace(from, to)` that could outgrow the budget.
fn precheck_replace(s: &Value, from: &Value, to: &Value) -> JResult<()> {
    if let (Some(s), Some(from), Some(to)) = (s.as_str(), from.as_str(), to.as_str()) {
        let count = if from.is_empty() {
            s.chars().count() + 1
        } else {
            s.matches(from).count()
        };
        built(s.len().saturating_add(count.saturating_mul(to.len())))?;
    }
    Ok(())
}

/// Refuses joining `seq` with `joiner` beyond the budget.
fn precheck_join(seq: &Value, joiner: &str) -> JResult<()> {
    let max = budget().max_bytes;
    let mut total = 0usize;
    if let Ok(iter) = seq.try_iter() {
        for (i, item) in iter.enumerate() {
            if i > 0 {
                total = total.saturating_add(joiner.len());
            }
            total = total.saturating_add(text_len_within(&item, max.saturating_sub(total))?);
        }
    }
    built(total)
}

/// A builtin filter run after a check of its arguments.
fn guarded(
    builtin: Value,
    check: fn(&[Value]) -> JResult<()>,
) -> impl Fn(&mut State, Rest<Value>) -> JResult<Value> + Send + Sync + 'static {
    move |state: &mut State, args: Rest<Value>| {
        check(&args)?;
        builtin.call(state, &args)
    }
}

fn positional(args: &[Value], i: usize) -> Option<&Value> {
    args.iter().filter(|a| !a.is_kwargs()).nth(i)
}

/// The string methods (Python's, from `minijinja_contrib::pycompat`) with
/// the growing ones checked first.
fn method_callback(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> JResult<Value> {
    if value.as_str().is_some() {
        match (method, args) {
            ("join", [seq]) => precheck_join(seq, value.as_str().unwrap_or_default())?,
            ("replace", [from, to, ..]) => precheck_replace(value, from, to)?,
            ("format", _) => precheck_format(value.as_str().unwrap_or_default(), args)?,
            _ => {}
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// Installs the checks, the counting formatter and the checked builtins in
/// `env`, with `budget`'s fuel.
pub(crate) fn install(env: &mut Environment<'static>, budget: TemplateBudget) {
    use minijinja::filters;
    env.set_fuel(Some(budget.fuel));
    env.set_formatter(format_counted);
    env.set_unknown_method_callback(method_callback);
    env.add_function(CHECK_CAT, check_cat);
    env.add_function(CHECK_ADD, check_add);
    env.add_function(CHECK_MUL, check_mul);
    env.add_function(CHECK_VALUE, check_value);
    env.add_filter(
        "join",
        guarded(Value::from_function(filters::join), |args| {
            let joiner = positional(args, 1).and_then(Value::as_str).unwrap_or("");
            precheck_join(args.first().unwrap_or(&Value::UNDEFINED), joiner)
        }),
    );
    env.add_filter(
        "replace",
        guarded(Value::from_function(filters::replace), |args| {
            match (positional(args, 1), positional(args, 2)) {
                (Some(from), Some(to)) => precheck_replace(&args[0], from, to),
                _ => Ok(()),
            }
        }),
    );
    env.add_filter(
        "indent",
        guarded(Value::from_function(filters::indent), |args| {
            let s = args.first().and_then(Value::as_str).unwrap_or_default();
            let lines = s.bytes().filter(|&b| b == b'\n').count() + 1;
            built(
                s.len()
                    .saturating_add(lines.saturating_mul(widths(&args[1..]))),
            )
        }),
    );
    env.add_filter(
        "format",
        guarded(Value::from_function(filters::format), |args| {
            let fmt = args.first().and_then(Value::as_str).unwrap_or_default();
            precheck_format(fmt, &args[1..])
        }),
    );
    env.add_filter(
        "slice",
        guarded(Value::from_function(filters::slice), |args| {
            items(
                positional(args, 1)
                    .and_then(Value::as_i64)
                    .unwrap_or(0)
                    .max(0) as usize,
            )
        }),
    );
    env.add_filter("string", |v: &Value| -> JResult<Value> {
        if v.as_str().is_some() {
            Ok(v.clone())
        } else {
            bounded_text(v, false).map(Value::from)
        }
    });
    env.add_filter("pprint", |v: &Value| bounded_text(v, true));
}

/// Checks a list that the template grows in place (`namespace` lists).
pub(crate) fn check_items(n: usize) -> JResult<()> {
    items(n)
}

/// The byte cap of the current render (for filters that build text).
pub(crate) fn max_bytes() -> usize {
    budget().max_bytes
}

/// One render's meter, installed on this thread while it lives.
pub(crate) struct Render(());

impl Render {
    pub(crate) fn start(budget: TemplateBudget) -> Render {
        METER.with(|m| {
            *m.borrow_mut() = Some(Meter {
                budget,
                written: 0,
                built: 0,
                exceeded: None,
            })
        });
        Render(())
    }

    /// Why the render went over its budget, if it did.
    pub(crate) fn finish(self) -> Option<String> {
        METER.with(|m| m.borrow_mut().take().and_then(|m| m.exceeded))
    }
}

impl Drop for Render {
    fn drop(&mut self) {
        METER.with(|m| m.borrow_mut().take());
    }
}

/// Evaluates a compiled template into a string.
pub(crate) fn eval(
    env: &Environment<'static>,
    t: &CompiledTemplate<'_>,
    ctx: Value,
) -> JResult<String> {
    let mut out = String::new();
    minijinja::machinery::eval(
        env,
        &t.instructions,
        ctx,
        &t.blocks,
        &mut minijinja::machinery::make_string_output(&mut out),
        AutoEscape::None,
    )?;
    Ok(out)
}
