//! `top` on a pseudo-terminal: it ends when its terminal goes away, and on SIGTERM, in every
//! state (here: after its replay has ended, where it used to spin at 90 % of a core reading
//! end-of-file for ever and ignore SIGTERM).

use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Longest a test waits for `top` to end (a hang guard: it ends in a fraction of a second).
const HANG_GUARD: Duration = Duration::from_secs(30);

/// `hvprof-analyze top CAPTURE --replay` with a pseudo-terminal as its controlling terminal and
/// standard streams; the terminal's controller side.
fn top_on_a_terminal() -> (Child, std::fs::File) {
    let (mut controller, mut device) = (-1, -1);
    // A terminal of 120 x 40 (with no size, top has no room to draw anything).
    let size = libc::winsize {
        ws_row: 40,
        ws_col: 120,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: openpty writes two descriptors into the two ints and reads `size`; no name or
    // termios given.
    let r = unsafe {
        libc::openpty(
            &mut controller,
            &mut device,
            std::ptr::null_mut(),
            std::ptr::null(),
            &size,
        )
    };
    assert_eq!(r, 0, "openpty: {}", std::io::Error::last_os_error());
    // The controller side stays in this process only (else `top` itself would keep its
    // terminal alive).
    // SAFETY: sets FD_CLOEXEC on a descriptor openpty just returned.
    unsafe { libc::fcntl(controller, libc::F_SETFD, libc::FD_CLOEXEC) };
    // SAFETY: both descriptors were just opened by openpty and are owned here alone.
    let (controller, device) = unsafe {
        (
            OwnedFd::from_raw_fd(controller),
            OwnedFd::from_raw_fd(device),
        )
    };
    let stdio = |fd: &OwnedFd| Stdio::from(fd.try_clone().unwrap());
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hvprof-analyze"));
    cmd.arg("top")
        .arg(super::data("sched-halt.log"))
        .args(["--replay", "--speed", "1000"])
        .stdin(stdio(&device))
        .stdout(stdio(&device))
        .stderr(stdio(&device));
    // SAFETY: between fork and exec only async-signal-safe calls: a new session, then the
    // terminal (standard input by now) made its controlling terminal.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().expect("cannot start hvprof-analyze top");
    drop(device);
    (child, std::fs::File::from(controller))
}

/// Reads what `top` draws (so that it never blocks on a full terminal) until it has said that
/// its replay ended: it is then in the state where it used to hang.
fn watch_until_the_replay_ends(terminal: &mut std::fs::File) {
    // SAFETY: sets O_NONBLOCK on a descriptor this test owns.
    unsafe {
        use std::os::fd::AsRawFd;
        let fd = terminal.as_raw_fd();
        libc::fcntl(
            fd,
            libc::F_SETFL,
            libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK,
        );
    }
    let end = Instant::now() + HANG_GUARD;
    let mut seen = Vec::new();
    let mut buf = [0u8; 65536];
    while Instant::now() < end {
        match terminal.read(&mut buf) {
            Ok(n) => seen.extend_from_slice(&buf[..n]),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
        if seen.windows(12).any(|w| w == b"source ended") {
            // A few more screens after it.
            std::thread::sleep(Duration::from_millis(300));
            let _ = terminal.read(&mut buf);
            return;
        }
    }
    panic!(
        "top did not say its replay ended within {HANG_GUARD:?}; it drew: {:?}",
        String::from_utf8_lossy(&seen)
    );
}

/// Waits for `child` to end, at most `HANG_GUARD`; its exit code, or 128 + the signal that
/// ended it.
fn ended(child: &mut Child) -> Option<i32> {
    use std::os::unix::process::ExitStatusExt;
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.code().or(status.signal().map(|s| 128 + s));
        }
        if start.elapsed() > HANG_GUARD {
            let _ = child.kill();
            panic!("top still ran {HANG_GUARD:?} after it should have ended");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn top_ends_when_its_terminal_goes_away_after_the_replay() {
    let (mut child, mut terminal) = top_on_a_terminal();
    watch_until_the_replay_ends(&mut terminal);
    drop(terminal);
    let code = ended(&mut child);
    // 129: it saw the hangup; 130: the SIGHUP the kernel sends asked it to stop.
    assert!(matches!(code, Some(129 | 130)), "exit code {code:?}");
}

#[test]
fn top_ends_on_sigterm_after_the_replay() {
    let (mut child, mut terminal) = top_on_a_terminal();
    watch_until_the_replay_ends(&mut terminal);
    // SAFETY: signals a child this test started and has not waited for.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let code = ended(&mut child);
    assert!(matches!(code, Some(0 | 130)), "exit code {code:?}");
    drop(terminal);
}
