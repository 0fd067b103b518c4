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

/// The fixture model with the real Qwen3.5 chat template, which refuses
/// some conversations (a system message after the first).
fn model_with_qwen35_template(tmp: &std::path::Path) -> std::path::PathBuf {
    let model = convert("qwen35moe-q4", tmp);
    std::fs::copy(
        fixtures().join("templates/qwen3.5/chat_template.jinja"),
        model.join("chat_template.jinja"),
    )
    .unwrap();
    model
}

/// Nothing recoverable ends the chat: an over-long message, a line that is
/// not UTF-8, a /load of a file whose conversation the template refuses and
/// a full context are each reported, and the conversation can still be
/// saved.
#[test]
fn recoverable_errors_keep_the_conversation() {
    use moeflux::text::chat::{ChatMessage, ChatTemplate, RenderOptions};
    let tmp = tempfile::tempdir().unwrap();
    let model = model_with_qwen35_template(tmp.path());
    let tok = Tokenizer::from_model_dir(&model).unwrap();
    let template = ChatTemplate::from_model_dir(&model).unwrap();
    let opts = RenderOptions {
        add_generation_prompt: true,
        ..Default::default()
    };
    let hi = tok
        .encode(
            &template.render(&[ChatMessage::user("Hi")], &opts).unwrap(),
            false,
        )
        .unwrap()
        .len();
    // Room for the first answer's first 4 tokens, then full.
    let ctx = (hi + 3).to_string();
    let args = [
        &["chat", "--model", s(&model), "--ctx", &ctx][..],
        &GREEDY[..],
    ]
    .concat();

    // A file whose snapshot is valid but whose conversation has a system
    // message after a user one.
    let good = tmp.path().join("good.chat");
    ok(&moeflux_stdin(
        &args,
        &format!("Hi\n/save {}\n", good.display()),
    ));
    let bytes = std::fs::read(&good).unwrap();
    let n = u64::from_le_bytes(bytes[8..16].try_into().unwrap()) as usize;
    let refused =
        serde_json::to_vec(&[ChatMessage::user("Hi"), ChatMessage::system("late")]).unwrap();
    let mut bad = bytes[..8].to_vec();
    bad.extend((refused.len() as u64).to_le_bytes());
    bad.extend(&refused);
    bad.extend(&bytes[16 + n..]);
    let bad_file = tmp.path().join("bad.chat");
    std::fs::write(&bad_file, bad).unwrap();

    let saved = tmp.path().join("after.chat");
    let long = "word ".repeat(3 * hi);
    let mut script = Vec::new();
    script.extend(format!("{long}\n").as_bytes());
    script.extend(b"caf\xe9 in latin-1\n");
    script.extend(format!("/load {}\n", bad_file.display()).as_bytes());
    script.extend(b"Hi\nAnd then?\n");
    script.extend(format!("/save {}\n", saved.display()).as_bytes());
    let out = moeflux_stdin_bytes(&args, &script);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let errors: Vec<&str> = err.lines().filter(|l| l.contains("error: ")).collect();
    assert_eq!(errors.len(), 4, "{err}");
    assert!(
        errors[0].contains(&format!("more than the context of {ctx}")),
        "{err}"
    );
    assert!(errors[1].contains("not valid UTF-8"), "{err}");
    assert!(errors[2].contains("bad.chat"), "{err}");
    assert!(
        errors[2].contains("System message must be at the beginning"),
        "{err}"
    );
    assert!(errors[3].contains("more than the context of"), "{err}");
    assert!(err.contains("is full"), "{err}");
    assert!(err.contains("(saved "), "{err}");
    // The saved conversation is the one answer to Hi.
    let saved = std::fs::read(&saved).unwrap();
    let n = u64::from_le_bytes(saved[8..16].try_into().unwrap()) as usize;
    let messages: Vec<ChatMessage> = serde_json::from_slice(&saved[16..16 + n]).unwrap();
    assert_eq!(messages.len(), 2);
    assert_eq!(messages[0].text(), "Hi");
}

/// `/load` refuses a file larger than any chat file of the model could be
/// without reading it, and one whose header lies about its length.
#[test]
fn load_caps_the_file_size() {
    let tmp = tempfile::tempdir().unwrap();
    let model = convert("qwen35moe-q4", tmp.path());
    let huge = tmp.path().join("huge.chat");
    let f = std::fs::File::create(&huge).unwrap();
    f.set_len(1 << 40).unwrap(); // sparse: 1 TiB
    let lying = tmp.path().join("lying.chat");
    let mut b = b"MFLXCHAT".to_vec();
    b.extend(u64::MAX.to_le_bytes());
    std::fs::write(&lying, b).unwrap();
    let (stdout, stderr) = chat(
        &model,
        &format!("/load {}\n/load {}\nHi\n", huge.display(), lying.display()),
    );
    let errors: Vec<&str> = stderr.lines().filter(|l| l.contains("error: ")).collect();
    assert_eq!(errors.len(), 2, "{stderr}");
    assert!(errors[0].contains("more than a chat file"), "{stderr}");
    assert!(errors[1].contains("does not fit the file"), "{stderr}");
    let (first, _) = chat(&model, "Hi\n");
    assert_eq!(stdout, first);
}

/// `/save` to a symbolic link, a directory or a FIFO is refused with the
/// path named; the link's target is untouched; a regular file still works.
#[test]
fn save_refuses_what_is_not_a_regular_file() {
    let tmp = tempfile::tempdir().unwrap();
    let model = convert("qwen35moe-q4", tmp.path());
    let victim = tmp.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let link = tmp.path().join("link.chat");
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    let dir = tmp.path().join("dir.chat");
    std::fs::create_dir(&dir).unwrap();
    let fifo = tmp.path().join("fifo.chat");
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let good = tmp.path().join("good.chat");
    let script = format!(
        "Hi\n/save {}\n/save {}\n/save {}\n/save {}\n",
        link.display(),
        dir.display(),
        fifo.display(),
        good.display()
    );
    let (_, stderr) = chat(&model, &script);
    let errors: Vec<&str> = stderr.lines().filter(|l| l.contains("error: ")).collect();
    assert_eq!(errors.len(), 3, "{stderr}");
    assert!(
        errors[0].contains("link.chat") && errors[0].contains("symbolic link"),
        "{stderr}"
    );
    assert!(
        errors[1].contains("dir.chat") && errors[1].contains("directory"),
        "{stderr}"
    );
    assert!(
        errors[2].contains("fifo.chat") && errors[2].contains("not a regular file"),
        "{stderr}"
    );
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert!(good.is_file());
}
