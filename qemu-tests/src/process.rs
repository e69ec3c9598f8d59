//! Starting an emulator, watching its serial log, and ending it: at the end marker, when it has
//! used up its CPU-time limit (or, as a last resort, its wall-time limit), at Ctrl-C, or when it
//! exits by itself.
//!
//! The limit is on the emulator's CPU time, read from `/proc/<pid>/stat`: other work on the
//! machine (a parallel build, another emulator, a CPU hog per core) slows the emulator's wall
//! clock but not the CPU time it needs, so a run is judged by the work it did, not by how busy
//! the machine was. The wall-time limit only catches an emulator that stopped using the CPU.
//!
//! Each emulator runs in its own process group (so a timeout can kill all of it, and Ctrl-C on the
//! terminal reaches only us: we then kill the emulators we started), and dies with the thread that
//! started it (`PR_SET_PDEATHSIG`) should we be killed outright.

use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, ExitStatus, Stdio};
use std::sync::Once;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::emulator::{self, Emulator, RunFiles};
use crate::log::SerialLog;

/// The few libc functions this module needs (std links libc already).
mod sys {
    use std::ffi::{c_int, c_ulong};

    pub const SIGHUP: c_int = 1;
    pub const SIGINT: c_int = 2;
    pub const SIGKILL: c_int = 9;
    pub const SIGTERM: c_int = 15;
    pub const PR_SET_PDEATHSIG: c_int = 1;
    pub const SC_CLK_TCK: c_int = 2;

    unsafe extern "C" {
        pub fn kill(pid: c_int, sig: c_int) -> c_int;
        pub fn signal(signum: c_int, handler: extern "C" fn(c_int)) -> usize;
        pub fn prctl(option: c_int, ...) -> c_int;
        pub fn sysconf(name: c_int) -> std::ffi::c_long;
    }

    /// Clock ticks per second of `/proc/<pid>/stat`'s times.
    pub fn clock_ticks() -> u64 {
        // SAFETY: sysconf reads a configuration value; no memory is passed.
        let n = unsafe { sysconf(SC_CLK_TCK) };
        u64::try_from(n).ok().filter(|&n| n > 0).unwrap_or(100)
    }

    /// `prctl(PR_SET_PDEATHSIG, SIGKILL)`.
    pub fn die_with_parent() -> std::io::Result<()> {
        // SAFETY: prctl with PR_SET_PDEATHSIG takes one unsigned long argument and touches no
        // memory of ours; it is async-signal-safe (a plain system call).
        let rc = unsafe { prctl(PR_SET_PDEATHSIG, SIGKILL as c_ulong) };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);
static HANDLER: Once = Once::new();

extern "C" fn on_signal(_signum: std::ffi::c_int) {
    // Only an atomic store: async-signal-safe.
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Turns SIGINT, SIGTERM and SIGHUP into a flag ([`interrupted`]) that the run loops poll, so
/// they can kill their emulators before we exit. Idempotent.
pub fn install_interrupt_handler() {
    HANDLER.call_once(|| {
        for sig in [sys::SIGINT, sys::SIGTERM, sys::SIGHUP] {
            // SAFETY: `on_signal` only stores to an atomic, which is async-signal-safe; glibc's
            // `signal` installs it with BSD semantics (restartable system calls).
            unsafe {
                sys::signal(sig, on_signal);
            }
        }
    });
}

/// Whether Ctrl-C (or SIGTERM/SIGHUP) arrived since [`install_interrupt_handler`].
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunEnd {
    /// The serial log showed the end marker (the emulator then exited or was killed).
    Marker,
    /// The emulator exited before the end marker appeared.
    Exited(ExitStatus),
    /// The emulator used up its limit first (what it used, and the limit); it was killed.
    TimedOut(String),
    /// Ctrl-C (or SIGTERM/SIGHUP); the emulator was killed.
    Interrupted,
}

impl RunEnd {
    /// A reason to print when the run did not reach its end marker.
    pub fn describe(&self, end_marker: &str) -> String {
        match self {
            Self::Marker => format!("reached {end_marker:?}"),
            Self::Exited(status) => {
                format!("the emulator exited ({status}) before printing {end_marker:?}")
            }
            Self::TimedOut(what) => format!("timed out: {what}"),
            Self::Interrupted => "interrupted".to_owned(),
        }
    }
}

/// What one run gave.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    /// How it ended.
    pub end: RunEnd,
    /// Wall time from start to end.
    pub elapsed: Duration,
    /// The emulator's CPU time (last reading before it ended).
    pub cpu: Duration,
    /// The whole serial log.
    pub serial: SerialLog,
}

/// One emulator run.
#[derive(Debug, Clone)]
pub struct Launch<'a> {
    /// The emulator.
    pub emulator: &'a Emulator,
    /// Number of CPUs.
    pub cpus: u32,
    /// Where the run's files go.
    pub files: &'a RunFiles,
    /// The run ends once the serial log contains this.
    pub end_marker: &'a str,
    /// Kill the emulator when it has used this much (`None`: no limit).
    pub limit: Option<Limit>,
}

/// How much an emulator run may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    /// The emulator's CPU time (user + system, all its threads).
    pub cpu: Duration,
    /// Wall time: only for an emulator that stops using the CPU (blocked, stopped).
    pub wall: Duration,
}

impl Limit {
    /// `cpu` of CPU time, and `wall_factor` times as much wall time.
    pub fn cpu(cpu: Duration, wall_factor: u32) -> Self {
        Self {
            cpu,
            wall: cpu.saturating_mul(wall_factor),
        }
    }
}

/// The CPU time (user + system, all threads) process `pid` has used so far, from
/// `/proc/<pid>/stat` (fields 14 and 15, after the parenthesised command name).
pub fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_cpu_time(&stat, sys::clock_ticks())
}

fn parse_cpu_time(stat: &str, ticks_per_second: u64) -> Option<Duration> {
    // The command name may hold spaces and parentheses: the fields start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    // After ')': state (3), ppid (4), ... utime is field 14, stime field 15 (1-based).
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    let ticks = utime.checked_add(stime)?;
    Some(Duration::from_micros(
        ticks.saturating_mul(1_000_000) / ticks_per_second.max(1),
    ))
}

/// How long the emulator may take to exit by itself once the end marker appeared.
const GRACE: Duration = Duration::from_secs(2);
const POLL: Duration = Duration::from_millis(50);

/// A started emulator in its own process group.
struct Emu {
    child: Child,
    reaped: Option<ExitStatus>,
}

impl Emu {
    fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        if self.reaped.is_none() {
            self.reaped = self.child.try_wait().context("cannot poll the emulator")?;
        }
        Ok(self.reaped)
    }

    /// Kills the whole process group and reaps the emulator.
    fn kill(&mut self) -> Result<()> {
        if self.reaped.is_some() {
            return Ok(());
        }
        if let Ok(pgid) = i32::try_from(self.child.id()) {
            // SAFETY: kill has no memory-safety preconditions; the group is the one we created
            // with `process_group(0)` and have not reaped yet, so its id is still ours.
            unsafe {
                sys::kill(-pgid, sys::SIGKILL);
            }
        }
        let _ = self.child.kill();
        self.reaped = Some(self.child.wait().context("cannot reap the emulator")?);
        Ok(())
    }
}

impl Drop for Emu {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}

/// Reads what was appended to the serial log since the last call.
struct Tail<'a> {
    path: &'a Path,
    file: Option<File>,
    offset: u64,
}

impl Tail<'_> {
    fn read_new(&mut self, into: &mut Vec<u8>) -> Result<usize> {
        if self.file.is_none() {
            match File::open(self.path) {
                Ok(file) => self.file = Some(file),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
                Err(e) => {
                    return Err(e).with_context(|| format!("cannot open {}", self.path.display()));
                }
            }
        }
        let Some(file) = self.file.as_mut() else {
            return Ok(0);
        };
        file.seek(SeekFrom::Start(self.offset))
            .with_context(|| format!("cannot seek in {}", self.path.display()))?;
        let n = file
            .read_to_end(into)
            .with_context(|| format!("cannot read {}", self.path.display()))?;
        self.offset += n as u64;
        Ok(n)
    }
}

/// Whether `needle` starts a line of `haystack` (at its start or after a `\n`): the end marker
/// is a line of the hypervisor's own, and a guest's output never starts a line (it is prefixed
/// with `[vm] `), so no guest can end a run by printing the marker.
fn contains_line(haystack: &[u8], needle: &[u8]) -> bool {
    needle.is_empty()
        || haystack.starts_with(needle)
        || haystack
            .windows(needle.len() + 1)
            .any(|w| w[0] == b'\n' && &w[1..] == needle)
}

/// Starts the emulator and follows its serial log until the run ends; every new chunk of the
/// log is passed to `on_output` as it arrives.
pub fn launch(launch: &Launch<'_>, on_output: &mut dyn FnMut(&[u8])) -> Result<RunOutcome> {
    install_interrupt_handler();
    let files = launch.files;
    // Bochs refuses a disk whose lock file a killed run left behind (`<disk>.lock`).
    let mut lock = files.iso.clone().into_os_string();
    lock.push(".lock");
    let _ = std::fs::remove_file(&lock);
    // Every output of an earlier run in the folder goes, the channels' logs too: an emulator
    // without a virtio console or parallel port would leave the old one to join the capture.
    for path in [
        &files.serial_log,
        &files.lpt_log,
        &files.virtio_log,
        &files.emulator_log,
        &files.emulator_out,
    ] {
        if path.exists() {
            fs::remove_file(path).with_context(|| format!("cannot remove {}", path.display()))?;
        }
    }
    let mut cmd = emulator::command(launch.emulator, launch.cpus, files)?;
    let out = File::create(&files.emulator_out)
        .with_context(|| format!("cannot create {}", files.emulator_out.display()))?;
    let err = out
        .try_clone()
        .with_context(|| format!("cannot reopen {}", files.emulator_out.display()))?;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .process_group(0);
    // SAFETY: the closure runs in the child between fork and exec and only makes one
    // async-signal-safe system call (prctl); it allocates nothing and takes no lock.
    unsafe {
        cmd.pre_exec(sys::die_with_parent);
    }
    let program = cmd.get_program().to_string_lossy().into_owned();
    let start = Instant::now();
    let child = cmd
        .spawn()
        .with_context(|| format!("cannot start {program} (is it installed?)"))?;
    let mut emu = Emu {
        child,
        reaped: None,
    };

    let mut tail = Tail {
        path: &files.serial_log,
        file: None,
        offset: 0,
    };
    let marker = launch.end_marker.as_bytes();
    let mut log = Vec::new();
    let mut marker_seen: Option<Instant> = None;
    let pid = emu.child.id();
    let mut pty = PtyDrain::new(pid);
    let mut cpu = Duration::ZERO;
    let end = loop {
        if let Some(t) = cpu_time(pid) {
            cpu = t;
        }
        pty.poll();
        let before = log.len();
        if tail.read_new(&mut log)? > 0 {
            on_output(&log[before..]);
            if marker_seen.is_none() {
                let from = before.saturating_sub(marker.len() + 1);
                if contains_line(&log[from..], marker) {
                    marker_seen = Some(Instant::now());
                }
            }
        }
        if let Some(status) = emu.try_wait()? {
            break if marker_seen.is_some() {
                RunEnd::Marker
            } else {
                RunEnd::Exited(status)
            };
        }
        if let Some(seen) = marker_seen {
            if seen.elapsed() >= GRACE {
                emu.kill()?;
                break RunEnd::Marker;
            }
        } else if let Some(limit) = launch.limit {
            let wall = start.elapsed();
            if cpu >= limit.cpu || wall >= limit.wall {
                emu.kill()?;
                break RunEnd::TimedOut(format!(
                    "the emulator used {:.1} s of CPU time in {:.1} s (limits: {:.0} s of CPU, {:.0} s of wall time)",
                    cpu.as_secs_f64(),
                    wall.as_secs_f64(),
                    limit.cpu.as_secs_f64(),
                    limit.wall.as_secs_f64()
                ));
            }
        }
        if interrupted() {
            emu.kill()?;
            break RunEnd::Interrupted;
        }
        thread::sleep(POLL);
    };
    let elapsed = start.elapsed();
    // The emulator is gone: whatever it wrote last is in the file now.
    let before = log.len();
    if tail.read_new(&mut log)? > 0 {
        on_output(&log[before..]);
    }
    let end = match end {
        RunEnd::Exited(_) | RunEnd::TimedOut(_) if contains_line(&log, marker) => RunEnd::Marker,
        other => other,
    };
    Ok(RunOutcome {
        end,
        elapsed,
        cpu,
        serial: SerialLog::from_bytes(&log),
    })
}

/// The pseudo-terminal Bochs' term display opens for itself (its master side, `/dev/ptmx`) and
/// writes its screen to, a cursor escape sequence at every refresh. Nothing else reads it: once
/// its buffer is full (some 16 KB, a few minutes of a run) Bochs blocks in the write, and the run
/// makes no more progress until its wall limit kills it (a 13-minute kvm-unit-tests run stopped
/// so after 6 minutes). The launcher finds that terminal in `/proc/<pid>/fd` and its index in
/// `fdinfo`, opens the other side (`/dev/pts/N`) non-blocking and in raw mode (a canonical-mode
/// terminal holds a line without a newline back from the reader), and reads it empty at every
/// poll. QEMU opens none: the search stops after [`PTY_SEARCH`].
struct PtyDrain {
    pid: u32,
    slave: Option<File>,
    since: Instant,
}

/// How long after the start the launcher looks for the emulator's pseudo-terminal.
const PTY_SEARCH: Duration = Duration::from_secs(30);

impl PtyDrain {
    fn new(pid: u32) -> Self {
        PtyDrain {
            pid,
            slave: None,
            since: Instant::now(),
        }
    }

    fn poll(&mut self) {
        if self.slave.is_none() && self.since.elapsed() < PTY_SEARCH {
            self.slave = open_pty_slave(self.pid);
        }
        if let Some(f) = &mut self.slave {
            let mut buf = [0u8; 4096];
            // Non-blocking: WouldBlock (nothing more) or an error (Bochs gone) ends it.
            while matches!(f.read(&mut buf), Ok(n) if n > 0) {}
        }
    }
}

/// The slave side of the pseudo-terminal process `pid` holds the master of, opened
/// non-blocking and in raw mode.
fn open_pty_slave(pid: u32) -> Option<File> {
    use std::os::unix::fs::OpenOptionsExt;
    use std::os::unix::io::AsRawFd;
    let fds = fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
    let index = fds.flatten().find_map(|e| {
        let target = fs::read_link(e.path()).ok()?;
        if target != Path::new("/dev/ptmx") {
            return None;
        }
        let info = fs::read_to_string(format!(
            "/proc/{pid}/fdinfo/{}",
            e.file_name().to_string_lossy()
        ))
        .ok()?;
        info.lines()
            .find_map(|l| l.strip_prefix("tty-index:"))
            .and_then(|n| n.trim().parse::<u32>().ok())
    })?;
    let slave = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(format!("/dev/pts/{index}"))
        .ok()?;
    let fd = slave.as_raw_fd();
    // SAFETY: `fd` is open for the duration (owned by `slave`); `t` is a plain struct that
    // tcgetattr fills and cfmakeraw and tcsetattr read, with no pointers kept.
    unsafe {
        let mut t: libc::termios = std::mem::zeroed();
        if libc::tcgetattr(fd, &mut t) == 0 {
            libc::cfmakeraw(&mut t);
            libc::tcsetattr(fd, libc::TCSANOW, &t);
        }
    }
    Some(slave)
}

/// The last `n` lines of a text file, with terminal control sequences removed (Bochs' term
/// display writes escape codes); empty if the file cannot be read.
pub fn file_tail(path: &Path, n: usize) -> Vec<String> {
    let Ok(bytes) = fs::read(path) else {
        return Vec::new();
    };
    let text = String::from_utf8_lossy(&bytes);
    let lines: Vec<String> = text
        .lines()
        .map(strip_control)
        .filter(|line| !line.trim().is_empty())
        .collect();
    lines[lines.len().saturating_sub(n)..].to_vec()
}

/// Removes ANSI escape sequences and other control characters from one line.
pub fn strip_control(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ params final-byte; other escapes: ESC + one char.
            if chars.peek() == Some(&'[') {
                chars.next();
                for c in chars.by_ref() {
                    if ('@'..='~').contains(&c) {
                        break;
                    }
                }
            } else if matches!(chars.next(), Some('(' | ')')) {
                // Character-set designation: ESC ( X.
                chars.next();
            }
        } else if c == '\t' || !c.is_control() {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process that opens a pseudo-terminal's master and writes 40 KB of cursor escapes to
    /// it without ever opening the slave side (as Bochs' term display does) blocks once the
    /// terminal's buffer is full (checked by hand: it never ends); with the drain it finishes.
    #[test]
    fn a_pseudo_terminal_the_emulator_writes_is_drained() {
        // TIOCSPTLCK (unlockpt) is 0x40045431 on x86-64.
        let script = "import os, fcntl, struct\n\
                      m = os.open('/dev/ptmx', os.O_RDWR | os.O_NOCTTY)\n\
                      fcntl.ioctl(m, 0x40045431, struct.pack('i', 0))\n\
                      for i in range(20000):\n    os.write(m, b'\\x1b[?25h\\x1b[?25l\\x1b[?12l')\n";
        let Ok(mut child) = std::process::Command::new("python3")
            .args(["-c", script])
            .spawn()
        else {
            eprintln!("no python3: skipped");
            return;
        };
        let mut drain = PtyDrain::new(child.id());
        // Generous: the write takes milliseconds once drained; without the drain it never ends.
        let start = Instant::now();
        let status = loop {
            drain.poll();
            if let Some(s) = child.try_wait().unwrap() {
                break Some(s);
            }
            if start.elapsed() > Duration::from_secs(120) {
                let _ = child.kill();
                break None;
            }
            thread::sleep(POLL);
        };
        assert!(drain.slave.is_some(), "the pseudo-terminal was found");
        assert!(status.is_some_and(|s| s.success()), "the writer finished");
    }

    #[test]
    fn cpu_time_from_proc_stat() {
        let stat = "4242 (bochs-bin (x) y) R 1 2 3 4 5 6 7 8 9 10 1500 250 0 0 20 0 1 0 100 2 3";
        assert_eq!(
            parse_cpu_time(stat, 100),
            Some(Duration::from_millis(17_500))
        );
        assert_eq!(parse_cpu_time("garbage", 100), None);
        // This process has a stat file of its own.
        assert!(cpu_time(std::process::id()).is_some());
    }

    #[test]
    fn strip_control_removes_escapes() {
        assert_eq!(strip_control("\u{1b}[2J\u{1b}[1;1Hhello\r"), "hello");
        assert_eq!(strip_control("a\u{1b}(Bb\tc"), "ab\tc");
    }

    #[test]
    fn contains_finds_marker_at_a_line_start() {
        assert!(contains_line(
            b"xx\r\nhvprof: power off (acpi)",
            b"hvprof: power off"
        ));
        assert!(contains_line(b"hvprof: power off", b"hvprof: power off"));
        assert!(!contains_line(b"hvprof: power", b"hvprof: power off"));
        assert!(!contains_line(
            b"[evil] hvprof: power off (acpi)",
            b"hvprof: power off"
        ));
    }

    #[test]
    fn run_end_descriptions() {
        assert_eq!(
            RunEnd::TimedOut("used 60 s".into()).describe("m"),
            "timed out: used 60 s"
        );
        assert!(RunEnd::Interrupted.describe("m").contains("interrupted"));
    }
}
