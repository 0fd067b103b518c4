//! `moeflux chat` driven through standard input: answers equal `run`'s,
//! earlier turns are not evaluated again, `/save` + `/load` continue the
//! conversation exactly, Ctrl-C stops an answer but not the program.

mod common;

use std::io::{Read, Write};
use std::process::Stdio;

use common::*;
use moeflux::text::tokenizer::Tokenizer;

const GREEDY: [&str; 5] = ["--temp", "0", "-n", "6", "--ignore-eos"];

fn chat(model: &std::path::Path, script: &str) -> (String, String) {
    let args = [&["chat", "--model", s(model)][..], &GREEDY[..]].concat();
    let out = moeflux_stdin(&args, script);
    let stdout = ok(&out);
    (stdout, text(&out.stderr))
}

/// `(prompt tokens evaluated, reused)` of every answer's statistics line.
fn prompt_counts(stderr: &str) -> Vec<(usize, usize)> {
    stderr
        .lines()
        .filter(|l| l.contains("generated "))
        .map(|l| {
            let after = l.split("prompt ").nth(1).unwrap();
            let n = after.split(' ').next().unwrap().parse().unwrap();
            let reused = after
                .split(" reused)")
                .next()
                .filter(|_| after.contains(" reused)"))
                .map(|x| x.rsplit('(').next().unwrap().parse().unwrap())
                .unwrap_or(0);
            (n, reused)
        })
        .collect()
}

#[test]
fn first_answer_equals_run_and_later_turns_reuse_the_prefix() {
    let tmp = tempfile::tempdir().unwrap();
    let model = convert("qwen35moe-q4", tmp.path());
    let (stdout, stderr) = chat(&model, "Hello\nAnd then?\n/exit\n");
    let run = ok(&moeflux(
        &[
            &["run", "--model", s(&model), "-p", "Hello"][..],
            &GREEDY[..],
        ]
        .concat(),
    ));
    assert!(stdout.starts_with(&run), "chat {stdout:?} vs run {run:?}");
    assert!(stdout.len() > run.len(), "no second answer: {stderr}");

    let tok = Tokenizer::from_model_dir(&model).unwrap();
    let first_prompt = tok
        .encode(
            "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
            false,
        )
        .unwrap()
        .len();
    let counts = prompt_counts(&stderr);
    assert_eq!(counts.len(), 2, "{stderr}");
    assert_eq!(counts[0], (first_prompt, 0), "{stderr}");
    // The second turn starts from the first turn's prompt at least.
    assert!(counts[1].1 >= first_prompt, "{stderr}");
}

#[test]
fn save_and_load_continue_the_conversation_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let model = convert("qwen35moe-q4", tmp.path());
    let file = tmp.path().join("conv.chat");
    let (straight, _) = chat(&model, "Hi\nWhat next?\n");
    let script = format!(
        "Hi\n/save {f}\n/clear\nSomething else\n/load {f}\nWhat next?\n/exit\n",
        f = file.display()
    );
    let (resumed, stderr) = chat(&model, &script);
    assert!(file.is_file());
    assert!(stderr.contains("(saved "), "{stderr}");
    assert!(stderr.contains("(loaded "), "{stderr}");
    // stdout: answer to Hi, answer to "Something else", answer to What next?
    let (fresh_other, _) = chat(&model, "Something else\n");
    let (first, _) = chat(&model, "Hi\n");
    assert_eq!(
        resumed,
        format!("{first}{fresh_other}{}", &straight[first.len()..])
    );
}

#[test]
fn bad_commands_and_files_are_reported_and_the_chat_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let model = convert("qwen35moe-q4", tmp.path());
    let junk = tmp.path().join("junk.chat");
    std::fs::write(&junk, b"not a chat file at all").unwrap();
    let script = format!(
        "/load {}\n/load {}\n/save\n/frobnicate\nHi\n",
        junk.display(),
        tmp.path().join("missing.chat").display()
    );
    let (stdout, stderr) = chat(&model, &script);
    let errors: Vec<&str> = stderr.lines().filter(|l| l.contains("error: ")).collect();
    assert_eq!(errors.len(), 4, "{stderr}");
    assert!(errors[0].contains("not a moeflux chat file"), "{stderr}");
    assert!(errors[1].contains("missing.chat"), "{stderr}");
    assert!(errors[3].contains("/frobnicate"), "{stderr}");
    let (first, _) = chat(&model, "Hi\n");
    assert_eq!(stdout, first);
    assert!(!stderr.contains("panicked"));
}

#[test]
fn ctrl_c_stops_the_answer_not_the_program() {
    let tmp = tempfile::tempdir().unwrap();
    let model = convert("qwen35moe-q4", tmp.path());
    let mut child = command(&["chat", "--model", s(&model), "-n", "100000", "--ignore-eos"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"Talk forever\n").unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 16];
    stdout.read_exact(&mut first).unwrap();
    let kill = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    stdin.write_all(b"/exit\n").unwrap();
    drop(stdin);
    let mut rest = Vec::new();
    stdout.read_to_end(&mut rest).unwrap();
    let out = child.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("(stopped)"), "{err}");
    assert!(err.contains("finish cancelled"), "{err}");
}
