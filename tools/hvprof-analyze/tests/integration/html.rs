//! The HTML report in a real browser: headless Chromium (Debian's `chromium`) opens the page made
//! from an end-to-end capture, renders it with no console message (the page has no script of its
//! own: any message is an error), and takes a screenshot, kept as an artifact in
//! `target/tmp/hvprof-analyze/report.png`. Skipped, with a message, where Chromium is not
//! installed (`cargo xtask test` installs it as root: package `chromium`).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::data;

const CHROMIUM: &str = "/usr/bin/chromium";

/// Runs Chromium headless on `page` with `args`; (stdout, stderr).
fn chromium(page: &Path, profile: &Path, args: &[String]) -> (String, String) {
    let child = Command::new(CHROMIUM)
        .args([
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--no-first-run",
            "--hide-scrollbars",
            "--enable-logging=stderr",
            "--v=0",
            "--window-size=1280,2400",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(format!("file://{}", page.display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start chromium");
    // Read its output while it runs (the DOM fills a pipe), with a time limit.
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let Ok(out) = rx.recv_timeout(Duration::from_secs(180)) else {
        let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
        panic!("chromium did not finish in 180 s");
    };
    let out = out.expect("chromium output");
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Console messages in Chromium's log (`...:INFO:CONSOLE:12] "Uncaught ..."`, or
/// `CONSOLE(12)` in older builds).
fn console_lines(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.contains(":CONSOLE") || l.contains("CONSOLE(") || l.contains("Uncaught"))
        .collect()
}

#[test]
fn html_report_renders_in_chromium_without_console_errors() {
    if !Path::new(CHROMIUM).exists() {
        eprintln!(
            "SKIPPED html_report_renders_in_chromium_without_console_errors: {CHROMIUM} is not installed (apt-get install chromium)"
        );
        return;
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("hvprof-analyze");
    std::fs::create_dir_all(&dir).unwrap();
    let page = dir.join("report.html");
    let shot = dir.join("report.png");
    let _ = std::fs::remove_file(&shot);
    let out = Command::new(env!("CARGO_BIN_EXE_hvprof-analyze"))
        .arg("html")
        .arg(data("sched-3vms-1pcpu.log"))
        .arg("--hypervisor")
        .arg(data("hvprof-3a995a71.sym"))
        .arg("--image")
        .arg(data("mix.elf"))
        .arg("-o")
        .arg(&page)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let profile = dir.join("chromium-profile");

    // The rendered DOM: every section, both charts.
    let (dom, stderr) = chromium(&page, &profile, &["--dump-dom".into()]);
    assert!(
        console_lines(&stderr).is_empty(),
        "console messages:\n{}",
        console_lines(&stderr).join("\n")
    );
    for want in [
        "id=\"timeline\"",
        "id=\"flame\"",
        "id=\"host\"",
        "id=\"guests\"",
        "id=\"stat\"",
        "work_a",
        "PREEMPTION_TIMER",
    ] {
        assert!(dom.contains(want), "the rendered page lacks {want}");
    }
    assert!(dom.matches("<svg").count() >= 2, "both charts are inline");

    // The screenshot, kept.
    let (_, stderr) = chromium(
        &page,
        &profile,
        &[format!("--screenshot={}", shot.display())],
    );
    assert!(
        console_lines(&stderr).is_empty(),
        "console messages:\n{}",
        console_lines(&stderr).join("\n")
    );
    let png = std::fs::read(&shot).unwrap_or_else(|e| {
        panic!(
            "no screenshot at {} ({e}); chromium said:\n{stderr}",
            shot.display()
        )
    });
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert!(png.len() > 20_000, "a blank page? {} bytes", png.len());
    eprintln!("screenshot: {}", shot.display());
    pcpu_row_shows_each_vm(&png);
}

/// The screenshot's timeline: the three VMs that take turns on the one pCPU of
/// `sched-3vms-1pcpu.log` each have their colour in the pCPU row (the first row, above the vCPU
/// rows and the legend: the topmost band of VM colours), each over a fair part of it.
fn pcpu_row_shows_each_vm(png: &[u8]) {
    let decoder = png::Decoder::new(std::io::Cursor::new(png));
    let mut reader = decoder.read_info().expect("a PNG");
    let mut buf = vec![0; reader.output_buffer_size().expect("a size")];
    let info = reader
        .next_frame(&mut buf)
        .expect("the screenshot's pixels");
    let channels = info.color_type.samples();
    assert!(
        info.bit_depth == png::BitDepth::Eight && channels >= 3,
        "{info:?}"
    );
    let (w, h) = (info.width as usize, info.height as usize);
    let pixel = |x: usize, y: usize| {
        let i = (y * w + x) * channels;
        (buf[i], buf[i + 1], buf[i + 2])
    };
    let colors: Vec<(u8, u8, u8)> = (0..3)
        .map(|vm| {
            let c = hvprof_analyze::views::chart::vm_color(vm);
            (c.0, c.1, c.2)
        })
        .collect();
    let is_vm = |p: (u8, u8, u8)| colors.iter().position(|&c| c == p);
    let top = (0..h)
        .find(|&y| (0..w).any(|x| is_vm(pixel(x, y)).is_some()))
        .expect("no VM colour in the screenshot: the pCPU row is not coloured by VM");
    // The row's bars: 60 pixels from its top edge.
    let mut counts = [0usize; 3];
    for y in top..(top + 60).min(h) {
        for x in 0..w {
            if let Some(i) = is_vm(pixel(x, y)) {
                counts[i] += 1;
            }
        }
    }
    let all: usize = counts.iter().sum();
    for (vm, &n) in counts.iter().enumerate() {
        assert!(
            n * 10 >= all,
            "VM {vm}'s colour covers {n} of the {all} VM pixels of the pCPU row: expected about a third each ({counts:?})"
        );
    }
}

#[test]
fn console_errors_are_recognised() {
    let log = "[1:1:1122/110151.5:INFO:CONSOLE:1853] \"Uncaught ReferenceError: init is not defined\", source: file:///r.html (1853)\n\
               [2:2:1122/110151.1:WARNING:ui/base/idle/idle_linux.cc:111] None of the known D-Bus ScreenSaver services could be used.\n";
    assert_eq!(console_lines(log).len(), 1);
}
