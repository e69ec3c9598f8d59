//! A reader that stops early (`hvprof-analyze script LOG | head`) ends every command that writes
//! to standard output quietly, with success: no panic, no error message.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use hvprof_samplelog::synth::{self, CaptureOptions, SynthConfig};

/// A synthetic capture whose every output is larger than a pipe's buffer (64 KiB), with call
/// chains (for `--call-graph`).
fn capture() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("hvprof-analyze-pipes");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("capture.log");
    let c = synth::capture(
        &SynthConfig {
            pcpus: 2,
            samples_per_pcpu: 40_000,
            chains: true,
            ..SynthConfig::default()
        },
        &CaptureOptions::default(),
    );
    std::fs::write(&path, &c.bytes).unwrap();
    path
}

#[test]
fn a_reader_that_stops_early_ends_every_command_quietly() {
    let log = capture();
    let log = log.to_str().unwrap();
    let commands: [&[&str]; 12] = [
        &["report", log, "--top", "100000"],
        &["report", log, "--json"],
        &["report", log, "--call-graph", "--top", "100000"],
        &["report", log, "--preemptions", "--top", "100000"],
        &["stat", log, "--json"],
        &["script", log],
        &["timeline", log],
        &["flamegraph", log],
        &["html", log],
        &["export", log, "--pprof", "-"],
        &["export", log, "--firefox", "-"],
        &["decode", log, "--records"],
    ];
    for args in commands {
        let mut child = Command::new(env!("CARGO_BIN_EXE_hvprof-analyze"))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run hvprof-analyze");
        // The first bytes, then the pipe closed.
        let mut first = [0u8; 16];
        child.stdout.take().unwrap().read_exact(&mut first).unwrap();
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {:?}\n{stderr}", out.status);
        assert!(
            !stderr.contains("error") && !stderr.contains("panicked"),
            "{args:?}: {stderr}"
        );
    }
}
