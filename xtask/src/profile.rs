//! `cargo xtask profile [OPTIONS] -- COMMAND [ARGS...]`: one command, profiled in the Linux guest
//! under hvprof, then its report (docs/LINUX-GUESTS.md, "Profile your own program").
//!
//! The guest is the project's Linux image (`cargo xtask linux-image`, built here when missing).
//! What this run adds to it goes into a small initramfs appended to the image's (the kernel
//! unpacks both, the second over the first), so the image is never rebuilt for a run:
//!
//! - `/hvprof/run/argv`, `env`, `cwd`: the command exactly as given, read by the guest's
//!   `/bin/hvrun` (guests/linux/hvrun.c), which /init runs for `hvprof.run=@`;
//! - the files and folders of `--add`.
//!
//! Everything lands in `target/profile/`: the ISO, the serial log, `capture.log`, the guest root
//! the analyzer reads (the image's, hard-linked, with the added files), `report.html` and
//! `perf-script.txt`.

use std::ffi::OsString;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use linux_guest::initramfs::Initramfs;
use qemu_tests::emulator::{BOCHS_IPS_REALISTIC, Emulator, RunFiles};
use qemu_tests::iso::{IsoModule, IsoSpec, build_iso};
use qemu_tests::linux_scenarios::{KERNEL_CMDLINE, linux_dir};
use qemu_tests::process::{Launch, Limit, RunEnd, launch};
use qemu_tests::runner::DEFAULT_END_MARKER;
use qemu_tests::smp_scenarios::{parse_script, process_window};

use crate::EmulatorArg;
use crate::build::{build_analyzer, build_hypervisor};
use crate::target_dir;
use crate::tools::ensure_tools;

/// `cargo xtask profile`'s options.
#[derive(clap::Args, Clone, Debug)]
#[command(after_help = "Examples:
  cargo xtask profile -- /bin/w41 400
  cargo xtask profile --add ./myprog --env OMP_NUM_THREADS=2 -- ./myprog --size 'a b'
  cargo xtask profile --vcpus 2 --cpus 1 --stacks 16 -- /bin/shor 35 2 1
  cargo xtask profile --deb perl-base -- perl -e 'my $s = 0; $s += $_ % 7 for 1..300000'

The command runs in the guest as root, with its arguments exactly as given, in --cwd (default
/root, where --add puts files unless told otherwise). Its output is shown as it comes; the
exit status is the command's (127: it could not be started; 128+N: signal N; 124: stopped by
the budget).")]
pub struct ProfileArgs {
    /// vCPUs of the Linux VM.
    #[arg(long, default_value_t = 1)]
    pub vcpus: u16,
    /// CPUs of the emulated machine (pCPUs; default: one per vCPU).
    #[arg(long)]
    pub cpus: Option<u32>,
    /// The pCPU of each vCPU, comma-separated (default: vCPU i on pCPU i modulo --cpus).
    #[arg(long, value_name = "LIST")]
    pub pin: Option<String>,
    /// Sampling period: <n>ticks, <n>ns, <n>us or <n>ms (the Bochs clock is 1 GHz).
    #[arg(long, default_value = "8000ticks")]
    pub period: String,
    /// Call chains of at most N frames per sample (off: none).
    #[arg(long, default_value = "off", value_name = "N")]
    pub stacks: String,
    /// An environment variable for the command, KEY=VALUE. Repeatable.
    #[arg(long = "env", value_name = "KEY=VALUE")]
    pub env: Vec<String>,
    /// The command's working directory in the guest.
    #[arg(long, default_value = "/root", value_name = "DIR")]
    pub cwd: String,
    /// A file or folder to put in the guest: HOST, or HOST:GUEST (an absolute guest path;
    /// default: --cwd/<its name>). Repeatable.
    #[arg(long = "add", value_name = "HOST[:GUEST]")]
    pub add: Vec<String>,
    /// A Debian package to put in the guest: a name apt knows, or a .deb file. The packages
    /// its dependencies bring come too (not those essential to Debian, such as dpkg), and its
    /// debug files where apt's lists have PACKAGE-dbgsym (the analyzer names its functions by
    /// them). Downloads and unpackings are kept in target/profile-cache. Repeatable.
    #[arg(long = "deb", value_name = "PACKAGE")]
    pub deb: Vec<String>,
    /// Run this many copies of the command at once, copy i bound to vCPU i modulo --vcpus
    /// (each output line starts with "[copy i] "; the status is the first that is not 0).
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub copies: u32,
    /// The VM's memory.
    #[arg(long, default_value = "256M")]
    pub memory: String,
    /// A virtual PMU for the guest's own profiler (`perf` in the guest): off, cpu (its
    /// counters count the guest's run) or domain (and the hypervisor's work on its exits).
    #[arg(long, default_value = "off", value_parser = ["off", "cpu", "domain"])]
    pub vpmu: String,
    /// Stop the VM after this many seconds of guest time (at the 1 GHz clock; boot included).
    #[arg(long, default_value_t = 100.0, value_name = "SECONDS")]
    pub budget: f64,
    /// The emulator (default: qemu-kvm where nested VMX works, else bochs).
    #[arg(long, value_enum)]
    pub emulator: Option<EmulatorArg>,
    /// Show the hypervisor's and the kernel's console lines too.
    #[arg(long)]
    pub verbose: bool,
    /// The run's folder (ISO, logs, capture, guest root, reports).
    #[arg(long, value_name = "DIR", default_value = "target/profile")]
    pub out: PathBuf,
    /// The machine from a TOML configuration (`cargo xtask run --config`'s), the command
    /// running in its Linux VM (--vm), beside its other VMs: a noisy neighbour, say. That VM's
    /// initrd must be the project's image; its vCPUs, pins, memory and the machine's CPUs are
    /// the file's, and its period and stacks if it sets them.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["vcpus", "cpus", "pin", "memory"])]
    pub config: Option<PathBuf>,
    /// With --config: the Linux VM that runs the command (default: the only one).
    #[arg(long, value_name = "NAME", requires = "config")]
    pub vm: Option<String>,
    /// The command and its arguments.
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "COMMAND"
    )]
    pub command: Vec<OsString>,
}

/// A file or folder `--add` puts in the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Addition {
    host: PathBuf,
    guest: String,
}

/// `HOST` or `HOST:GUEST` (GUEST absolute); the host path must exist.
fn parse_addition(spec: &str, cwd: &str) -> Result<Addition> {
    let (host, guest) = match spec.rsplit_once(':') {
        Some((h, g)) if g.starts_with('/') && !h.is_empty() => (h, Some(g.to_owned())),
        _ => (spec, None),
    };
    let host = PathBuf::from(host);
    if std::fs::symlink_metadata(&host).is_err() {
        bail!("--add {spec}: {} does not exist", host.display());
    }
    let guest = match guest {
        Some(g) => g,
        None => {
            let name = host
                .canonicalize()
                .ok()
                .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .with_context(|| format!("--add {spec}: no file name"))?;
            format!("{}/{name}", cwd.trim_end_matches('/'))
        }
    };
    if guest.split('/').any(|c| c == "..") {
        bail!("--add {spec}: the guest path {guest} has \"..\" in it");
    }
    Ok(Addition { host, guest })
}

/// The argv file: each argument followed by a NUL byte. An argument cannot hold a NUL (no
/// command line can).
fn argv_bytes(command: &[OsString]) -> Vec<u8> {
    let mut out = Vec::new();
    for a in command {
        out.extend_from_slice(a.as_bytes());
        out.push(0);
    }
    out
}

/// The environment file: `KEY=VALUE` entries, each followed by a NUL byte.
fn env_bytes(env: &[String]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    for e in env {
        match e.split_once('=') {
            Some((k, _)) if !k.is_empty() => {}
            _ => bail!("--env {e:?}: expected KEY=VALUE"),
        }
        out.extend_from_slice(e.as_bytes());
        out.push(0);
    }
    Ok(out)
}

/// Adds `path`'s folders (not itself) to `fs`, each once.
fn add_parents(fs: &mut Initramfs, added: &mut Vec<String>, path: &str) -> Result<()> {
    let path = path.trim_start_matches('/');
    let mut at = String::new();
    let parts: Vec<&str> = path.split('/').collect();
    for part in &parts[..parts.len().saturating_sub(1)] {
        if !at.is_empty() {
            at.push('/');
        }
        at.push_str(part);
        if !added.contains(&at) {
            fs.dir(&at)?;
            added.push(at.clone());
        }
    }
    Ok(())
}

/// Adds the host file or folder `host` at guest path `guest` (folders whole, symbolic links as
/// links).
fn add_host(fs: &mut Initramfs, added: &mut Vec<String>, host: &Path, guest: &str) -> Result<()> {
    add_parents(fs, added, guest)?;
    let meta = std::fs::symlink_metadata(host)
        .with_context(|| format!("cannot read {}", host.display()))?;
    let path = guest.trim_start_matches('/');
    if meta.file_type().is_symlink() {
        let target = std::fs::read_link(host)?;
        fs.symlink(path, &target.to_string_lossy())?;
    } else if meta.is_dir() {
        if !added.iter().any(|a| a == path) {
            fs.dir(path)?;
            added.push(path.to_owned());
        }
        let mut entries: Vec<_> = std::fs::read_dir(host)?.collect::<Result<_, _>>()?;
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let name = e.file_name();
            let name = name.to_str().with_context(|| {
                format!("{}: a file name that is not UTF-8", e.path().display())
            })?;
            add_host(fs, added, &e.path(), &format!("{path}/{name}"))?;
        }
    } else {
        let data =
            std::fs::read(host).with_context(|| format!("cannot read {}", host.display()))?;
        fs.file(path, meta.permissions().mode(), data)?;
    }
    Ok(())
}

/// Adds the children of the host folder `tree` at the guest's root.
fn add_at_root(fs: &mut Initramfs, added: &mut Vec<String>, tree: &Path) -> Result<()> {
    let mut entries: Vec<_> = std::fs::read_dir(tree)?.collect::<Result<_, _>>()?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = e.file_name();
        let name = name
            .to_str()
            .with_context(|| format!("{}: a file name that is not UTF-8", e.path().display()))?;
        add_host(fs, added, &e.path(), &format!("/{name}"))?;
    }
    Ok(())
}

/// The run's own initramfs: the command, the packages' trees (`packages`), the added files.
fn overlay(args: &ProfileArgs, packages: &[PathBuf], additions: &[Addition]) -> Result<Vec<u8>> {
    let mut fs = Initramfs::new();
    let mut added = Vec::new();
    for d in ["hvprof", "hvprof/run"] {
        fs.dir(d)?;
        added.push(d.to_owned());
    }
    fs.file("hvprof/run/argv", 0o644, argv_bytes(&args.command))?;
    fs.file("hvprof/run/env", 0o644, env_bytes(&args.env)?)?;
    fs.file("hvprof/run/cwd", 0o644, args.cwd.as_bytes().to_vec())?;
    fs.file(
        "hvprof/run/copies",
        0o644,
        args.copies.to_string().into_bytes(),
    )?;
    for tree in packages {
        add_at_root(&mut fs, &mut added, tree)?;
    }
    for a in additions {
        add_host(&mut fs, &mut added, &a.host, &a.guest)?;
    }
    Ok(fs.to_cpio()?)
}

/// The image's initramfs with `overlay` after it. The kernel reads concatenated archives, each
/// starting at a multiple of 4 bytes (zero bytes between them are skipped).
fn joined_initramfs(base: &[u8], overlay: &[u8]) -> Vec<u8> {
    let mut out = base.to_vec();
    out.resize(base.len().next_multiple_of(4), 0);
    out.extend_from_slice(overlay);
    out
}

/// The analyzer's guest root: the image's tree hard-linked (copied where links fail), then the
/// trees `over` (packages and their debug files) and the added files over it.
fn guest_root(
    image_root: &Path,
    to: &Path,
    over: &[PathBuf],
    additions: &[Addition],
) -> Result<()> {
    if to.exists() {
        std::fs::remove_dir_all(to).with_context(|| format!("cannot remove {}", to.display()))?;
    }
    put_tree(image_root, to, true)?;
    for tree in over {
        put_tree(tree, to, false)?;
    }
    for a in additions {
        let dest = to.join(a.guest.trim_start_matches('/'));
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent)?;
        }
        put_tree(&a.host, &dest, false)?;
    }
    Ok(())
}

/// Puts the tree at `from` at `to`: files hard-linked when `link` (copied where that fails),
/// else copied over what is there; symbolic links as links.
fn put_tree(from: &Path, to: &Path, link: bool) -> Result<()> {
    let meta = std::fs::symlink_metadata(from)?;
    if std::fs::symlink_metadata(to).is_ok() && !meta.is_dir() {
        std::fs::remove_file(to)?;
    }
    if meta.file_type().is_symlink() {
        std::os::unix::fs::symlink(std::fs::read_link(from)?, to)?;
    } else if meta.is_dir() {
        std::fs::create_dir_all(to)?;
        for e in std::fs::read_dir(from)? {
            let e = e?;
            put_tree(&e.path(), &to.join(e.file_name()), link)?;
        }
    } else if !link || std::fs::hard_link(from, to).is_err() {
        std::fs::copy(from, to)?;
    }
    Ok(())
}

/// What the guest's console says about the command, line by line.
#[derive(Debug, Clone, PartialEq, Eq)]
enum GuestLine<'a> {
    /// A line (or, `cut`, a piece of a long line) of its stdout or stderr.
    Out {
        text: &'a str,
        stderr: bool,
        cut: bool,
    },
    /// How it ended: `exit N`, `signal N NAME`, `error: ...`.
    End(&'a str),
    /// /init's other lines (`start`, `done`, `aslr`, ...).
    Other(&'a str),
}

/// A console line of the guest's /init or hvrun (`[vm] [time] hvprof-guest: ...`), or None.
fn guest_line(line: &str) -> Option<GuestLine<'_>> {
    let (_, rest) = line.split_once("hvprof-guest: ")?;
    let rest = rest.trim_end_matches('\r');
    for (kind, stderr, cut) in [
        ("out+ ", false, true),
        ("err+ ", true, true),
        ("out ", false, false),
        ("err ", true, false),
    ] {
        if let Some(text) = rest.strip_prefix(kind) {
            return Some(GuestLine::Out { text, stderr, cut });
        }
    }
    if rest == "out" || rest == "err" {
        return Some(GuestLine::Out {
            text: "",
            stderr: rest == "err",
            cut: false,
        });
    }
    if rest.starts_with("exit ") || rest.starts_with("signal ") || rest.starts_with("error: ") {
        return Some(GuestLine::End(rest));
    }
    Some(GuestLine::Other(rest))
}

/// How the run ended, from the whole serial log: the command's exit status and what to say.
fn outcome(serial: &str, vm: &str) -> (u8, String) {
    let mut end = None;
    let mut rc = None;
    for line in serial.lines() {
        match guest_line(line) {
            Some(GuestLine::End(e)) => end = Some(e.to_owned()),
            Some(GuestLine::Other(o)) => {
                if let Some(n) = o.strip_prefix("done @ rc=") {
                    rc = n.trim().parse::<u8>().ok();
                }
            }
            _ => {}
        }
    }
    let stop_line = format!("vm {vm}: stopped: ");
    let stopped = serial.lines().find_map(|l| {
        l.split_once(stop_line.as_str())
            .map(|(_, r)| r.trim().to_owned())
    });
    match (rc, end) {
        (Some(rc), Some(end)) => (rc, end),
        (Some(rc), None) => (rc, format!("exit {rc}")),
        (None, _) => match stopped {
            Some(s) if s.contains("budget") => (
                124,
                format!(
                    "stopped by the budget before the command ended ({s}); the profile is of what ran"
                ),
            ),
            Some(s) => (125, format!("the VM stopped before the command ended: {s}")),
            None => (125, "the run ended before the VM stopped".to_owned()),
        },
    }
}

/// Shows the command's output as it comes (stdout and stderr apart) and, with `verbose`, every
/// other console line on stderr. The serial line carries text only: the sample log goes to the
/// parallel port (`channel=lpt`).
struct Echo {
    partial: Vec<u8>,
    verbose: bool,
    started: Option<Instant>,
}

impl Echo {
    fn feed(&mut self, bytes: &[u8]) {
        self.partial.extend_from_slice(bytes);
        while let Some(i) = self.partial.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.partial.drain(..=i).collect();
            // The hypervisor escapes what guests print; still, nothing that could drive the
            // terminal reaches it.
            let text: String = String::from_utf8_lossy(&line)
                .chars()
                .filter(|&c| c == '\t' || !c.is_control())
                .collect();
            self.line(&text);
        }
    }

    fn line(&mut self, line: &str) {
        match guest_line(line) {
            Some(GuestLine::Out { text, stderr, cut }) => {
                let end = if cut { "" } else { "\n" };
                if stderr {
                    eprint!("{text}{end}");
                } else {
                    print!("{text}{end}");
                    let _ = std::io::stdout().flush();
                }
            }
            Some(GuestLine::Other(note)) if note.starts_with("note: ") => {
                eprintln!("xtask: {note}");
            }
            Some(GuestLine::Other("start @")) => {
                self.started = Some(Instant::now());
                eprintln!("xtask: the command starts");
            }
            _ if self.verbose => eprintln!("{line}"),
            _ => {}
        }
    }
}

/// The pin list: `--pin`, else vCPU i on pCPU i modulo the CPUs.
fn pin_list(args: &ProfileArgs, cpus: u32) -> String {
    args.pin.clone().unwrap_or_else(|| {
        (0..u32::from(args.vcpus))
            .map(|i| (i % cpus.max(1)).to_string())
            .collect::<Vec<_>>()
            .join(",")
    })
}

/// Builds the Linux guest image when it is missing, or older than the guest's side of this
/// command (`guests/linux/hvrun.c`, `guests/linux/init`).
fn ensure_image() -> Result<()> {
    let image = linux_dir();
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let built = modified(&image.join("initramfs.cpio"));
    let sources = crate::workspace_root().join("guests/linux");
    let stale = ["hvrun.c", "init"]
        .iter()
        .any(|f| modified(&sources.join(f)) > built);
    if stale
        || !["bzImage", "vmlinux", "initramfs.cpio", "root/bin/hvrun"]
            .iter()
            .all(|f| image.join(f).exists())
    {
        eprintln!("xtask: building the Linux guest image first (cargo xtask linux-image)");
        crate::linux::image(false)?;
    }
    Ok(())
}

/// The guest's PATH for the command (/init's).
const GUEST_PATH: [&str; 3] = ["/usr/local/bin", "/usr/bin", "/bin"];

/// `path` (a guest path) in the guest tree at `root`, symbolic links followed inside the tree.
fn in_guest(root: &Path, path: &str) -> Result<PathBuf, &'static str> {
    let mut parts: Vec<String> = Vec::new();
    let mut todo: Vec<String> = path.split('/').rev().map(str::to_owned).collect();
    let mut links = 0;
    while let Some(part) = todo.pop() {
        match part.as_str() {
            "" | "." => continue,
            ".." => {
                parts.pop();
                continue;
            }
            _ => {}
        }
        parts.push(part);
        let here = root.join(parts.join("/"));
        if let Ok(target) = std::fs::read_link(&here) {
            links += 1;
            if links > 40 {
                return Err("Too many levels of symbolic links");
            }
            parts.pop();
            let target = target.to_string_lossy().into_owned();
            if target.starts_with('/') {
                parts.clear();
            }
            todo.extend(target.split('/').rev().map(str::to_owned));
        }
    }
    Ok(root.join(parts.join("/")))
}

/// Where the guest would find `command` (relative to `cwd`, or in its PATH), and that it could
/// start it: it exists, is an executable file, and is not an ELF for another machine (a file
/// that is not an ELF runs through its `#!` line or the shell, as execvp does). The error is
/// what the guest's execvp would say.
fn resolve_command(root: &Path, cwd: &str, command: &OsString) -> Result<PathBuf, String> {
    let name = command.to_string_lossy();
    if name.is_empty() {
        return Err("No such file or directory".to_owned());
    }
    let candidates: Vec<String> = if name.contains('/') {
        vec![if name.starts_with('/') {
            name.into_owned()
        } else {
            format!("{cwd}/{name}")
        }]
    } else {
        GUEST_PATH.iter().map(|d| format!("{d}/{name}")).collect()
    };
    let mut why = "No such file or directory".to_owned();
    for c in &candidates {
        let Ok(path) = in_guest(root, c) else {
            why = "Too many levels of symbolic links".to_owned();
            continue;
        };
        let Ok(meta) = std::fs::metadata(&path) else {
            continue;
        };
        if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
            why = "Permission denied".to_owned();
            continue;
        }
        let mut head = [0u8; 20];
        let n = std::fs::File::open(&path)
            .and_then(|mut f| std::io::Read::read(&mut f, &mut head))
            .unwrap_or(0);
        if n >= 20 && head[..4] == *b"\x7fELF" {
            let machine = u16::from_le_bytes([head[18], head[19]]);
            // x86-64, and i386 (the kernel runs 32-bit programs).
            if machine != 62 && machine != 3 {
                return Err(format!(
                    "Exec format error (an ELF file for machine {machine}, not x86: {c})"
                ));
            }
        }
        return Ok(path);
    }
    // /init links busybox's applets into /bin when it starts (`busybox --install -s /bin`): a
    // command there is found then. Where the applets cannot be listed here, the guest decides.
    if why == "No such file or directory" {
        let in_bin = |c: &String| c.strip_prefix("/bin/").map(str::to_owned);
        match busybox_applets(root) {
            Some(applets) => {
                if let Some(applet) = candidates
                    .iter()
                    .filter_map(in_bin)
                    .find(|a| applets.contains(a))
                {
                    return Ok(root.join("bin").join(applet));
                }
            }
            None => return Ok(PathBuf::from(&candidates[0])),
        }
    }
    Err(why)
}

/// The applets of the guest's busybox (`/bin/busybox --list`, a static x86-64 program run
/// here), or None when it cannot run here.
fn busybox_applets(root: &Path) -> Option<Vec<String>> {
    let out = Command::new(root.join("bin/busybox"))
        .arg("--list")
        .output()
        .ok()?;
    out.status.success().then(|| {
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_owned)
            .collect()
    })
}

/// The name the guest's kernel gives the command's process: its file name, cut to the 15 bytes
/// of a task's `comm`.
fn command_comm(command: &OsString) -> String {
    let bytes = command.as_bytes();
    let name = bytes.rsplit(|&b| b == b'/').next().unwrap_or(bytes);
    String::from_utf8_lossy(&name[..name.len().min(15)]).into_owned()
}

/// `cargo xtask profile`.
pub fn profile(args: &ProfileArgs) -> Result<ExitCode> {
    let started = Instant::now();
    // Bad input is refused before anything is built or booted.
    if args.vcpus == 0 {
        bail!("--vcpus must be at least 1");
    }
    if !args.cwd.starts_with('/') {
        bail!("--cwd {}: an absolute guest path", args.cwd);
    }
    if !args.budget.is_finite() || args.budget <= 0.0 {
        bail!("--budget must be a positive number of seconds");
    }
    let additions = args
        .add
        .iter()
        .map(|a| parse_addition(a, &args.cwd))
        .collect::<Result<Vec<_>>>()?;
    env_bytes(&args.env)?;
    if !(1..=64).contains(&args.copies) {
        bail!("--copies {}: 1 to 64", args.copies);
    }

    let image = linux_dir();
    ensure_image()?;
    let packages = crate::debs::prepare(
        &args.deb,
        &target_dir().join("profile-cache"),
        &image.join("root"),
    )?;
    describe_packages(&packages);
    ensure_tools()?;
    let hypervisor = build_hypervisor(false)?;
    let analyzer = build_analyzer()?;

    let dir = if args.out == Path::new("target/profile") {
        target_dir().join("profile")
    } else {
        args.out.clone()
    };
    std::fs::create_dir_all(&dir)?;
    let base = std::fs::read(image.join("initramfs.cpio"))
        .with_context(|| format!("cannot read {}", image.join("initramfs.cpio").display()))?;
    let initrd = dir.join("linux.cpio");
    let trees: Vec<PathBuf> = packages.packages.iter().map(|p| p.tree.clone()).collect();
    std::fs::write(
        &initrd,
        joined_initramfs(&base, &overlay(args, &trees, &additions)?),
    )?;
    let root = dir.join("root");
    let debug = packages.packages.iter().filter_map(|p| p.debug.clone());
    let over: Vec<PathBuf> = trees.iter().cloned().chain(debug).collect();
    guest_root(&image.join("root"), &root, &over, &additions)?;

    // A command the guest could not start is refused now, as the guest would refuse it, not
    // after a boot.
    if let Err(why) = resolve_command(&root, &args.cwd, &args.command[0]) {
        eprintln!(
            "xtask: error: cannot run \"{}\": {why} (in the guest's files: {})",
            args.command[0].to_string_lossy(),
            root.display()
        );
        return Ok(ExitCode::from(127));
    }

    let machine = match &args.config {
        Some(file) => config_machine(args, file, &image, &initrd, &dir)?,
        None => own_machine(args, &image, &initrd)?,
    };
    let cpus = machine.cpus;
    let iso = dir.join("hvprof.iso");
    build_iso(
        &IsoSpec {
            hypervisor: &hypervisor,
            cmdline: &machine.cmdline,
            modules: &machine.modules,
        },
        &dir.join("iso"),
        &iso,
    )?;
    let emulator = match crate::run::choose_emulator(
        args.emulator.or(machine.emulator),
        qemu_tests::emulator::DEFAULT_BOCHS_MODEL,
    )? {
        e @ Emulator::Bochs { .. } => e.with_ips(BOCHS_IPS_REALISTIC),
        e => e,
    };
    let files = RunFiles::in_dir(&dir, &iso, &emulator);
    eprintln!(
        "xtask: booting the Linux guest on {} ({cpus} CPU(s), {}), {:.1} s after the start; console log in {}",
        emulator.label(),
        match &args.config {
            Some(f) => format!("VMs of {}", f.display()),
            None => format!("{} vCPU(s)", args.vcpus),
        },
        started.elapsed().as_secs_f64(),
        files.serial_log.display()
    );
    let mut echo = Echo {
        partial: Vec::new(),
        verbose: args.verbose,
        started: None,
    };
    let run = launch(
        &Launch {
            emulator: &emulator,
            cpus,
            files: &files,
            end_marker: DEFAULT_END_MARKER,
            // The VM's budget stops the guest; this only stops an emulator that hangs.
            limit: Some(Limit {
                cpu: Duration::from_secs_f64(args.budget * 60.0 + 600.0),
                wall: Duration::from_secs_f64(args.budget * 120.0 + 1200.0),
            }),
        },
        &mut |bytes| echo.feed(bytes),
    )?;
    let boot_to_start = echo.started.map(|t| t.duration_since(started));
    let capture = dir.join("capture.log");
    std::fs::write(
        &capture,
        files.capture().context("cannot read the capture")?,
    )?;
    let serial = run.serial.text();
    let (status, said) = match run.end {
        RunEnd::Marker => outcome(serial, &machine.vm),
        RunEnd::Interrupted => (130, "interrupted".to_owned()),
        ref other => (
            125,
            format!(
                "the emulator run ended early: {}",
                other.describe(DEFAULT_END_MARKER)
            ),
        ),
    };
    eprintln!(
        "xtask: {said} (status {status}); {:.1} s in all{}",
        run.elapsed.as_secs_f64(),
        boot_to_start
            .map(|d| format!(
                ", the command started {:.1} s after `cargo xtask profile`",
                d.as_secs_f64()
            ))
            .unwrap_or_default()
    );

    // `perf script`'s text, then the report and the HTML page of the command's stretch (the
    // boot before it is the kernel's, not the command's), with every file that names addresses.
    let input = |cmd: &mut Command| {
        cmd.arg(&capture)
            .arg("--hypervisor")
            .arg(&hypervisor)
            .arg("--kernel")
            .arg(&machine.vmlinux)
            .arg("--guest-root")
            .arg(&root);
    };
    // The command's output, whole, from the capture (the output leaf).
    let kept = |stream: &str, file: &Path| -> Option<u64> {
        let ok = Command::new(&analyzer)
            .args(["output", "--vm", &machine.vm, "--stream", stream, "-o"])
            .arg(file)
            .arg(&capture)
            .status()
            .ok()?
            .success();
        ok.then(|| file.metadata().map(|m| m.len()).ok()).flatten()
    };
    let (out_file, err_file) = (dir.join("stdout.txt"), dir.join("stderr.txt"));
    if let (Some(o), Some(e)) = (kept("stdout", &out_file), kept("stderr", &err_file)) {
        eprintln!(
            "xtask: the command's output, whole: {} ({o} bytes), {} ({e} bytes)",
            out_file.display(),
            err_file.display()
        );
    }
    let script = dir.join("perf-script.txt");
    let mut s = Command::new(&analyzer);
    s.arg("script");
    input(&mut s);
    s.arg("-o").arg(&script);
    let scripted = s.status().context("cannot run hvprof-analyze")?.success();
    let comm = command_comm(&args.command[0]);
    // The stretch from the first sample of `hvrun` or the command (before its exec the child
    // is still `hvrun`) to the last: the parser and the window of the SMP scenarios.
    let window = scripted
        .then(|| std::fs::read_to_string(&script).ok())
        .flatten()
        .and_then(|text| parse_script(&text).ok())
        .and_then(|samples| process_window(&samples, &["hvrun", &comm]).ok());
    let stretch = |cmd: &mut Command| {
        if let Some(w) = &window {
            cmd.arg("--time").arg(w);
        }
    };
    match &window {
        Some(w) => eprintln!(
            "xtask: the report is of the command's stretch, --time {w} (seconds of the run: its first sample to its last)"
        ),
        None => eprintln!("xtask: no sample of the command: the report is of the whole run"),
    }
    let mut report = Command::new(&analyzer);
    report.arg("report");
    input(&mut report);
    stretch(&mut report);
    let reported = report.status()?.success();
    let html = dir.join("report.html");
    let mut h = Command::new(&analyzer);
    h.arg("html");
    input(&mut h);
    stretch(&mut h);
    h.arg("-o").arg(&html);
    let written = h.status()?.success();
    if reported && written && scripted {
        eprintln!(
            "xtask: capture {}; HTML report {}; perf script text {} (the whole run)",
            capture.display(),
            html.display(),
            script.display()
        );
    } else {
        eprintln!(
            "xtask: the analyzer failed on {} (see above)",
            capture.display()
        );
    }
    Ok(ExitCode::from(status))
}

/// The Linux VM's output store (`output=`): what the command writes is kept whole up to this.
pub const OUTPUT_STORE: &str = "64M";

/// The machine a run boots: the hypervisor's command line, the boot modules, the CPUs, the
/// emulator the configuration asks for, and the Linux VM's vmlinux.
struct Machine {
    /// The VM that runs the command.
    vm: String,
    cmdline: String,
    modules: Vec<IsoModule>,
    cpus: u32,
    emulator: Option<EmulatorArg>,
    vmlinux: PathBuf,
}

/// The machine of the options: one Linux VM, `linux`, booting the image with `initrd`.
fn own_machine(args: &ProfileArgs, image: &Path, initrd: &Path) -> Result<Machine> {
    let cpus = args.cpus.unwrap_or(u32::from(args.vcpus));
    let keys = linux_guest::KernelImage::from_vmlinux(image.join("vmlinux"))?
        .module_keys()
        .words()
        .join(" ");
    let budget = (args.budget * BOCHS_IPS_REALISTIC as f64) as u64;
    let kernel_args = format!(
        "vm=linux mem={} budget={budget} initrd=linux.cpio apic=on vpmu={} vcpus={} pin={} output={OUTPUT_STORE} {keys} {} printk.devkmsg=on hvprof.run=@",
        args.memory,
        args.vpmu,
        args.vcpus,
        pin_list(args, cpus),
        KERNEL_CMDLINE.replace(" acpi=off nolapic", ""),
    );
    Ok(Machine {
        vm: "linux".to_owned(),
        cmdline: format!(
            "export=end channel=lpt period={} stacks={}",
            args.period, args.stacks
        ),
        modules: vec![
            IsoModule::with_args(image.join("bzImage"), &kernel_args)?,
            IsoModule::with_args(initrd.to_path_buf(), "")?,
        ],
        cpus,
        emulator: None,
        vmlinux: image.join("vmlinux"),
    })
}

/// The machine of a configuration file (`--config`), the command in its Linux VM `--vm`.
fn config_machine(
    args: &ProfileArgs,
    file: &Path,
    image: &Path,
    initrd: &Path,
    dir: &Path,
) -> Result<Machine> {
    let mut plan = crate::config::load(file)?;
    let defaults = [
        format!("period={}", args.period),
        format!("stacks={}", args.stacks),
    ];
    let (vm, vmlinux) = plan.run_command_in(
        args.vm.as_deref(),
        &image.join("initramfs.cpio"),
        initrd,
        &defaults,
        &format!("output={OUTPUT_STORE}"),
    )?;
    eprintln!("{}", plan.describe());
    eprintln!("xtask: the command runs in VM {vm}");

    Ok(Machine {
        vm,
        cmdline: plan.cmdline.clone(),
        modules: plan.iso_modules(&dir.join("config-modules"))?,
        cpus: plan.cpus.unwrap_or(1),
        emulator: plan.emulator,
        vmlinux: vmlinux.unwrap_or_else(|| image.join("vmlinux")),
    })
}

/// Says which packages `--deb` put in the guest, what it did not follow, and which have no
/// debug files.
fn describe_packages(p: &crate::debs::Prepared) {
    if p.packages.is_empty() {
        return;
    }
    let names: Vec<String> = p
        .packages
        .iter()
        .map(|u| format!("{} {}", u.name, u.version))
        .collect();
    eprintln!("xtask: packages for the guest: {}", names.join(", "));
    if !p.essential.is_empty() {
        eprintln!(
            "xtask: not followed (essential to Debian, not needed to run a program): {}",
            p.essential.join(", ")
        );
    }
    if !p.unresolved.is_empty() {
        eprintln!(
            "xtask: warning: dependencies apt knows no package for (give one with --deb): {}",
            p.unresolved.join(", ")
        );
    }
    let without = p.without_debug();
    if !without.is_empty() {
        eprintln!(
            "xtask: no debug files in apt's lists for {} (Debian keeps them as PACKAGE-dbgsym in \
             its debian-debug archive: `deb http://deb.debian.org/debian-debug bookworm-debug \
             main` in apt's sources, then `apt-get update`); their functions are named from \
             their dynamic symbols where exported, else [unknown] FILE+0xOFFSET",
            without.join(", ")
        );
    }
}

/// The test program of [`check`]: a dynamic PIE without frame pointers, written and compiled
/// here. It prints each argument in hex (so the check sees every byte), one line to stderr,
/// then runs `heavy` for three quarters of its loop iterations and `light` for one quarter (the
/// same instructions per iteration: 75 % / 25 % of its user time), and exits with status 3.
const TEST_PROGRAM: &str = r#"#include <stdio.h>
static volatile unsigned long sink;
__attribute__((noinline)) static void heavy(unsigned long n)
{
    for (unsigned long i = 0; i < n; i++)
        sink += i + 3;
}
__attribute__((noinline)) static void light(unsigned long n)
{
    for (unsigned long i = 0; i < n; i++)
        sink += i + 5;
}
int main(int argc, char **argv)
{
    for (int i = 0; i < argc; i++) {
        printf("argv[%d]=", i);
        for (const unsigned char *p = (const unsigned char *)argv[i]; *p; p++)
            printf("%02x", *p);
        printf("\n");
    }
    fprintf(stderr, "a line to stderr\n");
    fflush(NULL);
    for (int r = 0; r < 40; r++) {
        heavy(300000);
        light(100000);
    }
    return 3;
}
"#;

/// The arguments [`check`] passes: spaces, an empty one, commas, `=`, quotes, a backslash,
/// non-ASCII, a leading dash.
const TEST_ARGS: [&str; 7] = ["a b", "", "x=y,z", "'\"", "back\\slash", "é ü", "-n"];

/// Writes C `source` to `dir/NAME.c` and compiles it with `gcc -O1 FLAGS` into `dir/NAME`, a
/// program the check puts into the guest.
pub(crate) fn compile_c(dir: &Path, name: &str, source: &str, flags: &[&str]) -> Result<PathBuf> {
    let src = dir.join(format!("{name}.c"));
    std::fs::write(&src, source)?;
    let prog = dir.join(name);
    let status = Command::new("gcc")
        .arg("-O1")
        .args(flags)
        .arg("-o")
        .arg(&prog)
        .arg(&src)
        .status()
        .context("cannot run gcc")?;
    if !status.success() {
        bail!("gcc failed on {}", src.display());
    }
    Ok(prog)
}

/// `cargo xtask test`'s stage for `cargo xtask profile`: each run is a child `cargo xtask
/// profile` (the two that boot at once, one per core), and each check reads what a user would
/// see: its output, its exit status and its report.
/// - a program written and compiled here (PIE, no frame pointers), in the machine of
///   `configs/profile-neighbour.toml` (`--config`) beside a noisy neighbour: its arguments
///   arrive byte for byte, its stdout and stderr come out apart, the status is its own (3), the
///   report gives `heavy` 75 % and `light` 25 % of its user samples within 3 points, and shows
///   the neighbour and the time it took as the Linux VM's steal;
/// - the same with `--vcpus 2 --cpus 1 --copies 2`: two processes, each 75/25, each copy's
///   lines marked;
/// - a command that does not exist, and an ELF for another machine: status 127 and the
///   reason, before anything boots;
/// - `--add` of a missing file, a file without execute permission, `--deb` of a package apt
///   does not know: refused before anything boots, naming it;
/// - two programs from Debian packages (`--deb`) in one guest, against callgrind
///   (`profile_debian`);
/// - 1.99 MB of output kept whole, then a crash (139, the signal said); an endless loop
///   stopped by `--budget` (124, the reason said, the loop in the profile).
pub fn check() -> Result<()> {
    // Built once here, not by both runs at once.
    ensure_image()?;
    build_hypervisor(false)?;
    build_analyzer()?;
    let dir = target_dir().join("profile-check");
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::create_dir_all(&dir)?;
    let prog = compile_c(
        &dir,
        "known",
        TEST_PROGRAM,
        &["-fPIE", "-pie", "-fomit-frame-pointer"],
    )?;
    // An ELF header for AArch64 (e_machine 183), executable.
    let arm = dir.join("arm-program");
    let mut header = vec![0u8; 64];
    header[..4].copy_from_slice(b"\x7fELF");
    header[4] = 2;
    header[5] = 1;
    header[18] = 183;
    std::fs::write(&arm, header)?;
    std::fs::set_permissions(&arm, std::fs::Permissions::from_mode(0o755))?;

    let xtask = std::env::current_exe()?;
    let run = |out: &str, extra: &[&str], command: &[&str]| {
        let mut c = Command::new(&xtask);
        c.arg("profile")
            .arg("--out")
            .arg(dir.join(out))
            .args(extra)
            .arg("--")
            .args(command)
            .stdin(std::process::Stdio::null());
        c
    };
    let prog_arg = prog.display().to_string();
    let known_argv = [&["./known"], &TEST_ARGS[..]].concat();
    // Beside a noisy neighbour, from a configuration file (`--config`).
    let neighbour = crate::workspace_root().join("configs/profile-neighbour.toml");
    let neighbour = neighbour.display().to_string();
    let mut known = run(
        "run-known",
        &["--config", &neighbour, "--add", &prog_arg],
        &known_argv,
    );
    let mut copies = run(
        "run-copies",
        &[
            "--vcpus", "2", "--cpus", "1", "--copies", "2", "--add", &prog_arg,
        ],
        &["./known"],
    );
    // Two boots at once, one per core.
    let spawn = |c: &mut Command| {
        c.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .context("cannot run cargo xtask profile")
    };
    // The guest's own perf on its virtual PMU, the longest run, beside all the others.
    let vpmu = spawn(&mut crate::profile_vpmu::command(&xtask, &dir)?)?;
    let (known, copies) = (spawn(&mut known)?, spawn(&mut copies)?);
    let known = known.wait_with_output()?;
    let copies = copies.wait_with_output()?;
    // The Debian programs, the flood of output and the endless loop, at once.
    let mut flood = run("run-flood", &[], &["sh", "-c", FLOOD]);
    let flood = spawn(&mut flood)?;
    let mut endless = run(
        "run-budget",
        &["--budget", "1.2"],
        &["sh", "-c", "while :; do :; done"],
    );
    let endless = spawn(&mut endless)?;
    let debian = spawn(&mut crate::profile_debian::command(&xtask, &dir))?;
    let flood = flood.wait_with_output()?;
    let endless = endless.wait_with_output()?;
    let debian = debian.wait_with_output()?;
    let vpmu = vpmu.wait_with_output()?;
    let output = |mut c: Command| c.output().context("cannot run cargo xtask profile");
    let missing = output(run("run-missing", &[], &["/no/such/program", "x"]))?;
    let arm_arg = format!("{}:/root/arm-program", arm.display());
    let foreign = output(run("run-foreign", &["--add", &arm_arg], &["./arm-program"]))?;
    let refused = output(run(
        "run-refused",
        &["--add", "/no/such/file"],
        &["/bin/true"],
    ))?;
    let data = dir.join("data.txt");
    std::fs::write(&data, "not a program\n")?;
    let data_arg = data.display().to_string();
    let not_executable = output(run("run-data", &["--add", &data_arg], &["./data.txt"]))?;
    let no_package = output(run(
        "run-no-package",
        &["--deb", "hvprof-no-such-package"],
        &["/bin/true"],
    ))?;

    let mut errors = Vec::new();
    // The known program.
    let stdout = String::from_utf8_lossy(&known.stdout);
    let want: Vec<String> = known_argv
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let hex: String = a.bytes().map(|b| format!("{b:02x}")).collect();
            format!("argv[{i}]={hex}")
        })
        .collect();
    let got: Vec<&str> = stdout.lines().filter(|l| l.starts_with("argv[")).collect();
    if got != want {
        errors.push(format!("arguments: got {got:?}, want {want:?}"));
    }
    if !String::from_utf8_lossy(&known.stderr).contains("a line to stderr") {
        errors.push("the program's stderr line was not shown on stderr".to_owned());
    }
    if stdout.contains("a line to stderr") {
        errors.push("the program's stderr line was shown on stdout".to_owned());
    }
    for (what, out) in [("known", &known), ("two copies", &copies)] {
        if out.status.code() != Some(3) {
            errors.push(format!("{what}: status {:?}, want 3", out.status.code()));
        }
    }
    let mut check_shares = |run: &str, processes: usize| match known_shares(&dir.join(run)) {
        Ok(found) => {
            if found.len() != processes {
                errors.push(format!(
                    "{run}: {} processes named known, want {processes}",
                    found.len()
                ));
            }
            for (process, heavy, light, samples) in found {
                println!(
                    "profile check: {run}: {process}: {samples} user samples in its file, heavy {heavy:.2} %, light {light:.2} %"
                );
                for (f, got, want) in [("heavy", heavy, 75.0), ("light", light, 25.0)] {
                    if (got - want).abs() > 3.0 {
                        errors.push(format!(
                            "{run}: {process}: {f} {got:.2} % of its user samples, want {want} ± 3 ({samples} samples)"
                        ));
                    }
                }
            }
        }
        Err(e) => errors.push(format!("{run}: report: {e:#}")),
    };
    check_shares("run-known", 1);
    check_shares("run-copies", 2);
    if let Err(e) = check_neighbour(&dir.join("run-known")) {
        errors.push(format!("run-known: {e:#}"));
    }
    if let Err(e) = check_flood(&dir.join("run-flood"), &flood) {
        errors.push(format!("run-flood: {e:#}"));
    }
    if let Err(e) = check_budget(&dir.join("run-budget"), &endless) {
        errors.push(format!("run-budget: {e:#}"));
    }
    errors.extend(crate::profile_debian::check(&dir, &debian));
    errors.extend(crate::profile_vpmu::check(&dir, &vpmu));
    let copies_out = String::from_utf8_lossy(&copies.stdout);
    for c in 0..2 {
        if !copies_out.contains(&format!("[copy {c}] argv[0]=")) {
            errors.push(format!("two copies: no line of copy {c} on stdout"));
        }
    }
    // Refused before anything boots.
    for (what, out, run, want, status) in [
        (
            "a missing command",
            &missing,
            "run-missing",
            "cannot run \"/no/such/program\": No such file or directory",
            Some(127),
        ),
        (
            "an ELF for another machine",
            &foreign,
            "run-foreign",
            "cannot run \"./arm-program\": Exec format error (an ELF file for machine 183",
            Some(127),
        ),
        (
            "--add of a missing file",
            &refused,
            "run-refused",
            "--add /no/such/file: /no/such/file does not exist",
            Some(1),
        ),
        (
            "a file without execute permission",
            &not_executable,
            "run-data",
            "cannot run \"./data.txt\": Permission denied",
            Some(127),
        ),
        (
            "--deb of a package apt does not know",
            &no_package,
            "run-no-package",
            "--deb hvprof-no-such-package: apt knows no package hvprof-no-such-package",
            Some(1),
        ),
    ] {
        let said = String::from_utf8_lossy(&out.stderr);
        if out.status.code() != status || !said.contains(want) {
            errors.push(format!(
                "{what}: status {:?} (want {status:?}), stderr without {want:?}: {:?}",
                out.status.code(),
                said.lines()
                    .filter(|l| l.starts_with("xtask"))
                    .collect::<Vec<_>>()
            ));
        }
        if dir.join(run).join("hvprof.iso").exists() {
            errors.push(format!(
                "{what}: an ISO was made: it should be refused before that"
            ));
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        bail!("{}", errors.join("; "))
    }
}

/// A command that writes megabytes, 1.99 MB of numbers to stdout and 3.9 KB to stderr, then
/// crashes (SIGSEGV).
const FLOOD: &str = "seq 1 300000; seq 1 1000 >&2; kill -SEGV $$";

/// The flood run: status 139 and the signal said (its crash), its output whole in `stdout.txt`
/// and `stderr.txt` (from the capture), the first 100 lines of each shown live and the note,
/// and no sample lost.
fn check_flood(dir: &Path, out: &std::process::Output) -> Result<()> {
    let lines = |n: u32| -> String { (1..=n).map(|i| format!("{i}\n")).collect() };
    let said = String::from_utf8_lossy(&out.stderr);
    if out.status.code() != Some(139) || !said.contains("signal 11") {
        bail!(
            "status {:?}, want 139 with \"signal 11\" said: {:?}",
            out.status.code(),
            said.lines()
                .filter(|l| l.starts_with("xtask"))
                .collect::<Vec<_>>()
        );
    }
    for (file, want) in [("stdout.txt", lines(300_000)), ("stderr.txt", lines(1000))] {
        let got = std::fs::read(dir.join(file)).with_context(|| format!("no {file}"))?;
        if got != want.as_bytes() {
            bail!(
                "{file}: {} bytes, want the {} bytes of the command's output",
                got.len(),
                want.len()
            );
        }
    }
    // The command's lines shown (its output is numbers; the report follows on stdout).
    let numbers = |text: &[u8]| {
        String::from_utf8_lossy(text)
            .lines()
            .filter(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_digit()))
            .count()
    };
    let (shown, shown_err) = (numbers(&out.stdout), numbers(&out.stderr));
    println!(
        "profile check: run-flood: 1,988,895 + 3,893 bytes whole in stdout.txt and stderr.txt; {shown} + {shown_err} lines shown live"
    );
    if shown != 100 || shown_err != 100 {
        bail!(
            "{shown} and {shown_err} lines of output on the terminal, want the first 100 of each"
        );
    }
    if !said.contains("all of it is in the capture") {
        bail!("no note that the rest of the output is in the capture");
    }
    let report = report_json(dir, 1)?;
    let lost = report.pointer("/lost").cloned().unwrap_or_default();
    let none = ["blocks", "samples", "events", "dropped", "damaged_frames"]
        .iter()
        .all(|k| lost.get(k).and_then(|v| v.as_u64()) == Some(0));
    if !none {
        bail!("the sample log lost something: {lost}");
    }
    Ok(())
}

/// The endless loop stopped by `--budget 1.2`: status 124, the reason said, and the profile
/// of what ran (the loop's shell, busy in user mode).
fn check_budget(dir: &Path, out: &std::process::Output) -> Result<()> {
    let said = String::from_utf8_lossy(&out.stderr);
    if out.status.code() != Some(124) || !said.contains("stopped by the budget") {
        bail!(
            "status {:?}, want 124 with the budget said: {:?}",
            out.status.code(),
            said.lines()
                .filter(|l| l.starts_with("xtask"))
                .collect::<Vec<_>>()
        );
    }
    let report = report_json(dir, 1000)?;
    let user: f64 = report_rows(&report, "linux")?
        .iter()
        .filter(|r| row_text(r, "process").starts_with("sh[") && row_text(r, "module") == "busybox")
        .filter_map(|r| r.get("samples").and_then(|s| s.as_f64()))
        .sum();
    println!("profile check: run-budget: status 124; the loop's shell has {user} user samples");
    // 1.2 s of guest time, about 0.65 s of it the boot: the loop runs over 0.3 s, 37,500
    // samples of 8,000 ticks.
    if user < 37_500.0 {
        bail!("the loop's shell has {user} user samples, want 37,500 or more");
    }
    Ok(())
}

/// The run at `dir` had the noisy neighbour of `configs/profile-neighbour.toml` beside the
/// Linux VM on its pCPU: the report shows it, and the time it took as the Linux VM's steal.
fn check_neighbour(dir: &Path) -> Result<()> {
    let report = report_json(dir, 1)?;
    let exact = |name: &str, key: &str| -> Result<f64> {
        report_vm(&report, name)?
            .pointer(&format!("/exact/{key}"))
            .and_then(|s| s.as_f64())
            .with_context(|| format!("no exact {key} for VM {name}"))
    };
    // The neighbour ran its budget, 10^9 ticks (exact, from the scheduling events), while the
    // Linux VM waited for it: steal.
    let running = exact("noisy", "ticks")? * exact("noisy", "running")? / 100.0;
    let steal = exact("linux", "steal")?;
    println!(
        "profile check: run-known: the neighbour ran {running:.0} ticks; linux's steal {steal:.2} % (exact)"
    );
    if (running - 1e9).abs() > 1e7 {
        bail!("the neighbour ran {running:.0} ticks, want its budget, 10^9, within 1 %");
    }
    if steal < 20.0 {
        bail!("the Linux VM's steal is {steal:.2} %, want 20 % or more (the neighbour's time)");
    }
    // Its kernel keeps its default mitigations: it isolates its page tables (KPTI), and the
    // hypervisor must have found so (the known program's shares, checked by name, need it; the
    // line is printed when the VM stops).
    let serial = std::fs::read_to_string(dir.join("serial.log"))?;
    if !serial.contains("the guest isolates its page tables (KPTI)") {
        bail!("the hypervisor did not find the Linux VM isolating its page tables (KPTI)");
    }
    println!("profile check: run-known: the Linux VM isolates its page tables (KPTI), found");
    Ok(())
}

/// `hvprof-analyze report --json --top N` of the run at `dir`, with the image's kernel and the
/// run's guest root.
pub(crate) fn report_json(dir: &Path, top: u32) -> Result<serde_json::Value> {
    let out = Command::new(build_analyzer()?)
        .arg("report")
        .arg(dir.join("capture.log"))
        .arg("--kernel")
        .arg(linux_dir().join("vmlinux"))
        .arg("--guest-root")
        .arg(dir.join("root"))
        .args(["--json", "--top", &top.to_string()])
        .output()?;
    if !out.status.success() {
        bail!(
            "hvprof-analyze report failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// VM `name` of a JSON report.
pub(crate) fn report_vm<'a>(
    report: &'a serde_json::Value,
    name: &str,
) -> Result<&'a serde_json::Value> {
    report
        .get("vms")
        .and_then(|v| v.as_array())
        .and_then(|vms| {
            vms.iter()
                .find(|v| v.get("name").and_then(|n| n.as_str()) == Some(name))
        })
        .with_context(|| format!("no VM {name} in the report"))
}

/// The rows of VM `name` of a JSON report.
pub(crate) fn report_rows<'a>(
    report: &'a serde_json::Value,
    name: &str,
) -> Result<&'a Vec<serde_json::Value>> {
    report_vm(report, name)?
        .get("rows")
        .and_then(|r| r.as_array())
        .with_context(|| format!("no rows for VM {name}"))
}

/// A row's text field (empty when missing).
pub(crate) fn row_text(r: &serde_json::Value, k: &str) -> String {
    r.get(k).and_then(|x| x.as_str()).unwrap_or("").to_owned()
}

/// Per process named `known` in the run at `dir`: its name, `heavy`'s and `light`'s shares of
/// its user-mode samples in its own file, and those samples.
fn known_shares(dir: &Path) -> Result<Vec<(String, f64, f64, f64)>> {
    let report = report_json(dir, 1000)?;
    let rows = report_rows(&report, "linux")?;
    let field = row_text;
    let mut processes: Vec<String> = rows
        .iter()
        .map(|r| field(r, "process"))
        .filter(|p| p.starts_with("known["))
        .collect();
    processes.sort();
    processes.dedup();
    let mut found = Vec::new();
    for p in processes {
        let mine: Vec<_> = rows
            .iter()
            .filter(|r| field(r, "process") == p && field(r, "module") == "known")
            .collect();
        let samples = |f: &str| {
            mine.iter()
                .filter(|r| f.is_empty() || field(r, "function") == f)
                .filter_map(|r| r.get("samples").and_then(|s| s.as_f64()))
                .sum::<f64>()
        };
        let total = samples("");
        if total < 1000.0 {
            bail!("only {total} user samples of {p} in its own file");
        }
        found.push((
            p,
            100.0 * samples("heavy") / total,
            100.0 * samples("light") / total,
            total,
        ));
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argv_keeps_every_byte_but_nul() {
        let args: Vec<OsString> = ["a b", "", "x=y,z", "'\"", "é"]
            .iter()
            .map(OsString::from)
            .collect();
        assert_eq!(argv_bytes(&args), b"a b\0\0x=y,z\0'\"\0\xc3\xa9\0");
    }

    #[test]
    fn env_entries_need_a_key() {
        assert_eq!(
            env_bytes(&["A=1".into(), "B==".into()]).unwrap(),
            b"A=1\0B==\0"
        );
        assert!(env_bytes(&["=1".into()]).is_err());
        assert!(env_bytes(&["NOVALUE".into()]).is_err());
    }

    #[test]
    fn additions_go_to_cwd_unless_told() {
        let a = parse_addition("Cargo.toml", "/root").unwrap();
        assert_eq!(a.guest, "/root/Cargo.toml");
        let a = parse_addition("Cargo.toml:/opt/x.toml", "/root").unwrap();
        assert_eq!(a.guest, "/opt/x.toml");
        let e = parse_addition("no-such-file", "/root")
            .unwrap_err()
            .to_string();
        assert!(e.contains("no-such-file does not exist"), "{e}");
    }

    #[test]
    fn guest_lines_are_told_apart() {
        assert_eq!(
            guest_line("[linux] [    1.5] hvprof-guest: out a b"),
            Some(GuestLine::Out {
                text: "a b",
                stderr: false,
                cut: false
            })
        );
        assert_eq!(
            guest_line("[linux] [    1.5] hvprof-guest: err+ xx"),
            Some(GuestLine::Out {
                text: "xx",
                stderr: true,
                cut: true
            })
        );
        assert_eq!(
            guest_line("[linux] [    1.5] hvprof-guest: out"),
            Some(GuestLine::Out {
                text: "",
                stderr: false,
                cut: false
            })
        );
        assert_eq!(
            guest_line("[linux] [ 2.0] hvprof-guest: signal 11 Segmentation fault"),
            Some(GuestLine::End("signal 11 Segmentation fault"))
        );
        assert_eq!(guest_line("vm linux: stopped"), None);
    }

    #[test]
    fn the_status_is_the_commands() {
        let log = "[linux] [1] hvprof-guest: start @\n[linux] [2] hvprof-guest: error: cannot run \"x\": No such file or directory\n[linux] [2] hvprof-guest: done @ rc=127\nvm linux: stopped: exit code 127 (port 0xf4)\n";
        let (rc, said) = outcome(log, "linux");
        assert_eq!(rc, 127);
        assert!(said.contains("cannot run"), "{said}");
        let log =
            "[linux] [1] hvprof-guest: start @\nvm linux: stopped: budget of 100 ticks used\n";
        assert_eq!(outcome(log, "linux").0, 124);
        assert_eq!(outcome(log, "other").0, 125);
    }

    #[test]
    fn output_lines_are_split_and_cleaned() {
        let mut e = Echo {
            partial: Vec::new(),
            verbose: false,
            started: None,
        };
        e.feed(b"[linux] [ 1] hvprof-guest: start @\r\n[linux] [ 1] hvprof-guest: out a");
        assert!(e.started.is_some());
        assert_eq!(e.partial, b"[linux] [ 1] hvprof-guest: out a");
        e.feed(b"b\x1b[2J\n");
        assert!(e.partial.is_empty());
    }

    #[test]
    fn the_commands_process_name_is_its_file_name_cut_to_15_bytes() {
        assert_eq!(
            command_comm(&OsString::from("./a/very-long-program-name")),
            "very-long-progr"
        );
        assert_eq!(command_comm(&OsString::from("sum")), "sum");
    }

    #[test]
    fn commands_are_found_as_the_guest_would() {
        let root = std::env::temp_dir().join(format!("hvprof-resolve-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("bin")).unwrap();
        std::fs::create_dir_all(root.join("root")).unwrap();
        let exe = |p: &Path, data: &[u8]| {
            std::fs::write(p, data).unwrap();
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
        };
        // Stands in for busybox: lists its applets.
        exe(
            &root.join("bin/busybox"),
            b"#!/bin/sh\nprintf 'true\\nls\\n'\n",
        );
        let mut elf = vec![0u8; 64];
        elf[..4].copy_from_slice(b"\x7fELF");
        std::os::unix::fs::symlink("busybox", root.join("bin/sh")).unwrap();
        std::os::unix::fs::symlink("/bin/busybox", root.join("root/abs")).unwrap();
        elf[18] = 183;
        exe(&root.join("root/arm"), &elf);
        std::fs::write(root.join("root/data"), b"x").unwrap();
        exe(&root.join("root/script"), b"echo hi\n");
        let r = |c: &str| resolve_command(&root, "/root", &OsString::from(c));
        assert_eq!(r("sh").unwrap(), root.join("bin/busybox"));
        assert_eq!(r("./abs").unwrap(), root.join("bin/busybox"));
        assert_eq!(r("/root/../bin/sh").unwrap(), root.join("bin/busybox"));
        assert!(r("./script").is_ok());
        assert_eq!(r("nothing").unwrap_err(), "No such file or directory");
        // Busybox's applets, linked into /bin when /init starts.
        assert_eq!(r("true").unwrap(), root.join("bin/true"));
        assert_eq!(r("/bin/ls").unwrap(), root.join("bin/ls"));
        assert!(r("/usr/bin/ls").is_err());
        assert_eq!(r("./data").unwrap_err(), "Permission denied");
        assert!(
            r("./arm")
                .unwrap_err()
                .starts_with("Exec format error (an ELF file for machine 183")
        );
        assert_eq!(r("").unwrap_err(), "No such file or directory");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn the_overlay_follows_the_image_at_a_multiple_of_four() {
        let joined = joined_initramfs(b"12345", b"070701");
        assert_eq!(&joined[..8], b"12345\0\0\0");
        assert_eq!(&joined[8..], b"070701");
    }
}
