//! `--config FILE`: a TOML file whose keys are long flags, so that a setup
//! (a server's model, port, key file, limits) is one file. Top-level keys
//! apply to every command that has the flag; a table named after a command
//! (`[serve]`) applies to that command and wins over the top level; a flag
//! given on the command line wins over both. `max_tokens` and `max-tokens`
//! are the same key.
//!
//! The file becomes command-line flags inserted after the subcommand's name,
//! so clap parses and validates its values exactly as it does typed flags,
//! and `--help` stays the one reference for what each key means. Every key
//! is checked against the flags of the commands, so a typo is an error
//! naming the file and the key, not a setting silently ignored.

use std::ffi::OsString;
use std::path::Path;

use anyhow::{bail, Context};
use clap::{Arg, ArgAction, Command};

/// The long flag that names the file (declared on the root command).
const CONFIG_FLAG: &str = "config";

/// `args` (the process's, program name first) with the settings of the
/// `--config` file they name inserted after the subcommand; unchanged when
/// they name none or no subcommand (clap then reports what is missing).
pub fn expand(args: Vec<OsString>, root: &Command) -> anyhow::Result<Vec<OsString>> {
    let Some(path) = config_path(&args) else {
        return Ok(args);
    };
    let Some((at, sub)) = find_subcommand(&args, root) else {
        return Ok(args);
    };
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("reading the config file {}", path.display()))?;
    let given = &args[at + 1..];
    let mut out = args[..=at].to_vec();
    (|| {
        for (arg, value) in settings(&text, root, sub)? {
            if !on_command_line(given, arg) {
                out.extend(to_flags(arg, &value)?);
            }
        }
        anyhow::Ok(())
    })()
    .with_context(|| format!("config file {}", path.display()))?;
    out.extend_from_slice(given);
    Ok(out)
}

/// The value of `--config FILE` / `--config=FILE` before any `--`.
fn config_path(args: &[OsString]) -> Option<std::path::PathBuf> {
    let flag = format!("--{CONFIG_FLAG}");
    let mut it = args.iter().skip(1);
    while let Some(a) = it.next() {
        let s = a.to_string_lossy();
        if s == "--" {
            break;
        }
        if s == flag {
            return it.next().map(Into::into);
        }
        if let Some(v) = s.strip_prefix(&format!("{flag}=")) {
            return Some(Path::new(v).to_path_buf());
        }
    }
    None
}

/// The index and command of the subcommand's name: the first word that is
/// not a root option or its value.
fn find_subcommand<'a>(args: &[OsString], root: &'a Command) -> Option<(usize, &'a Command)> {
    let mut i = 1;
    while i < args.len() {
        let s = args[i].to_string_lossy();
        if let Some(long) = s.strip_prefix("--") {
            let takes_value = !long.contains('=')
                && root
                    .get_arguments()
                    .any(|a| a.get_long() == Some(long) && a.get_action().takes_values());
            i += 1 + usize::from(takes_value);
            continue;
        }
        return root
            .get_subcommands()
            .find(|c| c.get_name() == s || c.get_all_aliases().any(|a| a == s))
            .map(|c| (i, c));
    }
    None
}

/// The flag named by a config key (`_` and `-` alike) among `cmd`'s
/// arguments and the root's global ones.
fn flag<'a>(key: &str, cmd: &'a Command, root: &'a Command) -> Option<&'a Arg> {
    let long = key.replace('_', "-");
    cmd.get_arguments()
        .chain(root.get_arguments().filter(|a| a.is_global_set()))
        .find(|a| a.get_long() == Some(long.as_str()))
}

/// The (flag, value) pairs the file sets for `sub`: its top-level keys that
/// are flags of `sub`, then its `[sub]` table's, which replace them. Every
/// key in the file must be a flag of some command (of its table's command
/// for a table), or it is an error.
fn settings<'a>(
    text: &str,
    root: &'a Command,
    sub: &'a Command,
) -> anyhow::Result<Vec<(&'a Arg, toml::Value)>> {
    let table: toml::Table = text.parse().context("not valid TOML")?;
    let mut out: Vec<(&Arg, toml::Value)> = Vec::new();
    let mut set = |arg: &'a Arg, value: toml::Value| {
        out.retain(|(a, _)| a.get_id() != arg.get_id());
        out.push((arg, value));
    };
    let mut tables = Vec::new();
    for (key, value) in &table {
        if let toml::Value::Table(t) = value {
            let Some(cmd) = root.find_subcommand(key) else {
                bail!(
                    "[{key}] is not a moeflux command (a table names the command its keys are for)"
                );
            };
            tables.push((cmd, t));
            continue;
        }
        check_key(key)?;
        match flag(key, sub, root) {
            Some(arg) => set(arg, value.clone()),
            None if root.get_subcommands().any(|c| flag(key, c, root).is_some()) => {}
            None => bail!("key '{key}' is not a flag of any moeflux command"),
        }
    }
    for (cmd, t) in tables {
        for (key, value) in t {
            check_key(key)?;
            let Some(arg) = flag(key, cmd, root) else {
                bail!(
                    "key '{key}' in [{}] is not a flag of `moeflux {}` (see `moeflux {} --help`)",
                    cmd.get_name(),
                    cmd.get_name(),
                    cmd.get_name()
                );
            };
            if cmd.get_name() == sub.get_name() {
                set(arg, value.clone());
            }
        }
    }
    Ok(out)
}

fn check_key(key: &str) -> anyhow::Result<()> {
    if key.replace('_', "-") == CONFIG_FLAG {
        bail!("key '{key}': a config file cannot name another");
    }
    Ok(())
}

/// Whether `given` (the words after the subcommand, up to `--`) sets `arg`.
fn on_command_line(given: &[OsString], arg: &Arg) -> bool {
    let long = arg.get_long().map(|l| format!("--{l}"));
    let short = arg.get_short().map(|c| format!("-{c}"));
    given
        .iter()
        .map(|a| a.to_string_lossy())
        .take_while(|s| s != "--")
        .any(|s| {
            long.as_ref()
                .is_some_and(|l| s == *l || s.starts_with(&format!("{l}=")))
                || short.as_ref().is_some_and(|p| s.starts_with(p.as_str()))
        })
}

/// The command-line words for one setting: `--flag` for a switch set to
/// true (nothing for false), `--flag=VALUE` (so a value starting with `-`
/// stays a value), once per item of an array for a repeatable flag.
fn to_flags(arg: &Arg, value: &toml::Value) -> anyhow::Result<Vec<OsString>> {
    let long = arg.get_long().expect("config keys are long flags");
    let word = |v: &toml::Value| -> anyhow::Result<OsString> {
        let text = match v {
            toml::Value::String(s) => s.clone(),
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            toml::Value::Datetime(d) => d.to_string(),
            toml::Value::Array(_) | toml::Value::Table(_) => {
                bail!("key '{long}': expected a single value")
            }
        };
        Ok(format!("--{long}={text}").into())
    };
    match (arg.get_action(), value) {
        (ArgAction::SetTrue, toml::Value::Boolean(b)) => Ok(if *b {
            vec![format!("--{long}").into()]
        } else {
            vec![]
        }),
        (ArgAction::SetTrue, _) => bail!("key '{long}': a switch takes true or false"),
        (ArgAction::Append, toml::Value::Array(items)) => items.iter().map(word).collect(),
        (_, toml::Value::Array(_)) => bail!("key '{long}' takes one value, not an array"),
        (_, v) => Ok(vec![word(v)?]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser, Subcommand};

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(subcommand)]
        command: Cmd,
        #[arg(long, global = true)]
        config: Option<std::path::PathBuf>,
        #[arg(long, global = true)]
        models_dir: Option<std::path::PathBuf>,
    }

    #[derive(Debug, Subcommand)]
    enum Cmd {
        Serve {
            #[arg(long, default_value_t = 8080)]
            port: u16,
            #[arg(long)]
            model: Option<String>,
            #[arg(long)]
            no_ui: bool,
            #[arg(long)]
            stop: Vec<String>,
            #[arg(short = 'n', long)]
            max_tokens: Option<u32>,
        },
        Run {
            #[arg(long)]
            model: Option<String>,
            #[arg(long)]
            temp: Option<f32>,
            prompt: Option<String>,
        },
    }

    fn run(cfg: &str, argv: &[&str]) -> anyhow::Result<Vec<String>> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("moeflux.toml");
        std::fs::write(&path, cfg).unwrap();
        let mut args: Vec<OsString> = vec!["moeflux".into()];
        for a in argv {
            args.push(a.replace("CFG", path.to_str().unwrap()).into());
        }
        let out = expand(args, &Cli::command())?;
        Cli::try_parse_from(&out)?;
        Ok(out
            .into_iter()
            .skip(1)
            .map(|s| s.into_string().unwrap())
            .filter(|s| s != "--config" && !s.contains("moeflux.toml"))
            .collect())
    }

    #[test]
    fn keys_become_flags_and_the_command_line_wins() {
        let cfg = r#"
model = "/m/top"
temp = 0.5
[serve]
model = "/m/served"
port = 9000
no_ui = true
stop = ["-x", "END"]
max-tokens = 64
"#;
        let got = run(cfg, &["--config", "CFG", "serve", "--port", "1"]).unwrap();
        assert_eq!(
            got,
            [
                "serve",
                "--max-tokens=64",
                "--model=/m/served",
                "--no-ui",
                "--stop=-x",
                "--stop=END",
                "--port",
                "1"
            ]
        );
        // The top-level key reaches `run`, which has it; `-n` counts as given.
        let got = run(cfg, &["run", "--config=CFG", "hi"]).unwrap();
        assert_eq!(got, ["run", "--model=/m/top", "--temp=0.5", "hi"]);
        let got = run(cfg, &["--config", "CFG", "serve", "-n", "3"]).unwrap();
        assert!(
            !got.iter().any(|s| s.starts_with("--max-tokens")),
            "{got:?}"
        );
        let got = run("no_ui = false\n", &["--config", "CFG", "serve"]).unwrap();
        assert_eq!(got, ["serve"]);
    }

    #[test]
    fn bad_files_are_errors_naming_the_key() {
        for (cfg, want) in [
            (
                "prot = 1\n",
                "key 'prot' is not a flag of any moeflux command",
            ),
            (
                "[serve]\ntemp = 1\n",
                "key 'temp' in [serve] is not a flag of `moeflux serve`",
            ),
            ("[serv]\nport = 1\n", "[serv] is not a moeflux command"),
            (
                "[serve]\nport = [1, 2]\n",
                "key 'port' takes one value, not an array",
            ),
            (
                "[serve]\nno-ui = 1\n",
                "key 'no-ui': a switch takes true or false",
            ),
            ("config = \"x\"\n", "cannot name another"),
            ("port = \n", "not valid TOML"),
        ] {
            let e = format!("{:#}", run(cfg, &["--config", "CFG", "serve"]).unwrap_err());
            assert!(e.contains(want), "{cfg:?}: {e}");
            assert!(e.contains("moeflux.toml"), "{e}");
        }
        // A value clap refuses is clap's error, as if typed.
        let e = run("[serve]\nport = 70000\n", &["--config", "CFG", "serve"]).unwrap_err();
        assert!(e.to_string().contains("70000"), "{e}");
        let e = expand(
            vec![
                "moeflux".into(),
                "--config".into(),
                "/nonexistent/m.toml".into(),
                "serve".into(),
            ],
            &Cli::command(),
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("/nonexistent/m.toml"), "{e:#}");
    }

    #[test]
    fn without_config_or_subcommand_args_are_unchanged() {
        let args: Vec<OsString> = ["moeflux", "serve", "--port", "2"].map(Into::into).to_vec();
        assert_eq!(expand(args.clone(), &Cli::command()).unwrap(), args);
        let args: Vec<OsString> = ["moeflux", "--config", "x.toml"].map(Into::into).to_vec();
        assert_eq!(expand(args.clone(), &Cli::command()).unwrap(), args);
    }
}
