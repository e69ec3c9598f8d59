//! Linux guests from Debian packages: `cargo xtask linux-image`, `linux-truth`, `linux-qemu`.
//!
//! Everything lands in `target/linux/`:
//!
//! ```text
//! debs/                 the downloaded .deb files (kept: a second run downloads nothing)
//! bzImage               the kernel as Debian ships it (linux-image-*-cloud-amd64)
//! vmlinux               its decompressed ELF (stripped, with kallsyms and .BTF inside)
//! config                the kernel's .config
//! bin/                  w41, w41-fp and zeroread (frame pointers), shor, hvexit, hvrun, lockholder,
//!                       shootdown: static
//!                       non-PIE workloads built with the host gcc
//! bin/                  shor-dyn, hashload: dynamic PIE workloads against Debian's libraries
//! root/                 the guest's file tree (the initramfs is made of it, less
//!                       usr/lib/debug): busybox, /init (guests/linux/init), bin/, Debian's
//!                       libc, libgomp, libquantum.so.8, dynamic busybox (usr/bin), the kernel
//!                       modules hashload needs, libc's debug file (usr/lib/debug/.build-id);
//!                       `hvprof-analyze --guest-root target/linux/root` names their functions
//! initramfs.cpio.gz     root/ as the guest's initramfs
//! initramfs.cpio        the same, uncompressed (faster to boot under Bochs)
//! manifest.json         versions, sizes, the setup header, the task offsets
//! truth.json            native `perf record -e cpu-clock` function shares (linux-truth)
//! ```

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use linux_guest::initramfs::Initramfs;
use linux_guest::{BzImage, KernelImage};
use serde_json::json;

/// The Debian packages, by name (the version is whatever the package lists give).
const KERNEL_META: &str = "linux-image-cloud-amd64";
const BUSYBOX: &str = "busybox-static";
const LIBQUANTUM: &str = "libquantum-dev";
/// The shared libraries of the dynamic workloads, libc's debug symbols, Debian's dynamic busybox.
const LIBQUANTUM_SO: &str = "libquantum8";
const LIBC: &str = "libc6";
const LIBC_DEBUG: &str = "libc6-dbg";
const LIBGOMP: &str = "libgomp1";
const BUSYBOX_PIE: &str = "busybox";

/// The kernel modules the `hashload` workload needs, in load order (each after those it uses),
/// under `/lib/modules/<release>/`: the crypto API's user interface and the hash it runs.
pub const MODULES: [&str; 3] = [
    "kernel/crypto/af_alg.ko",
    "kernel/crypto/algif_hash.ko",
    "kernel/crypto/wp512.ko",
];

/// Debug files in the guest's tree: for the analyzer, not copied into the initramfs.
const DEBUG_DIR: &str = "usr/lib/debug";

/// The programs built into the guest's /bin.
const GUEST_PROGRAMS: [&str; 10] = [
    "w41",
    "w41-fp",
    "zeroread",
    "shor",
    "hvexit",
    "hvrun",
    "shor-dyn",
    "hashload",
    "lockholder",
    "shootdown",
];

/// The workloads and their default arguments in the guest (a few hundred million instructions
/// at most: the guest runs under an instruction-counting emulator at about 100 M instructions/s).
pub const WORKLOADS: [(&str, &str); 4] = [
    ("w41", "400"),
    ("shor", "35,2,1"),
    ("shor-dyn", "35,2,1"),
    ("hashload", "1024"),
];

/// The workloads whose instruction counts are the truth (hashload's work is in the kernel,
/// which callgrind does not see).
const INSTRUCTION_TRUTH: [&str; 3] = ["w41", "shor", "shor-dyn"];

/// The same work, repeated, for the native ground truth (about a second each).
const TRUTH_ARGS: [(&str, &[&str]); 2] = [("w41", &["20000"]), ("shor", &["35", "2", "1", "40"])];

/// The kernel command line for QEMU TCG: with it the Debian cloud kernel reaches /init in about
/// 1.5 s (measured on 6.1.0-56); `cryptomgr.notests` alone saves about 7 s of boot in Bochs.
pub const BASE_CMDLINE: &str = "console=ttyS0 quiet nokaslr mitigations=off cryptomgr.notests";

pub fn linux_dir() -> PathBuf {
    crate::target_dir().join("linux")
}

fn guest_src() -> PathBuf {
    crate::workspace_root().join("guests/linux")
}

/// Writes `bytes` as `path` through a new file renamed over it: a `target/linux` shared with
/// other checkouts through hard links keeps their copy, and a reader never sees half a file.
fn replace_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".new");
    std::fs::write(&tmp, bytes)
        .with_context(|| format!("writing {}", Path::new(&tmp).display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("replacing {}", path.display()))?;
    Ok(())
}

/// Runs a command, returns its stdout; an error names the command and shows its stderr.
pub(crate) fn output(cmd: &mut Command, hint: &str) -> Result<String> {
    let shown = format!("{cmd:?}").replace('"', "");
    let out = match cmd.output() {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            bail!("{} not found. {hint}", cmd.get_program().to_string_lossy())
        }
        Err(e) => return Err(e).with_context(|| format!("cannot run {shown}")),
    };
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(8).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!(
            "{shown} failed ({}):\n  {}\n{hint}",
            out.status,
            tail.join("\n  ")
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The cached .deb of `package` (the newest if several), if any.
pub(crate) fn cached_deb(
    debs: &Path,
    package: &str,
    version: Option<&str>,
) -> Result<Option<PathBuf>> {
    let prefix = format!("{package}_");
    let mut found: Vec<(std::time::SystemTime, PathBuf)> = Vec::new();
    for entry in std::fs::read_dir(debs).with_context(|| format!("reading {}", debs.display()))? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if !name.starts_with(&prefix) || !name.ends_with(".deb") {
            continue;
        }
        if let Some(v) = version
            && deb_field(&path, "Version")? != v
        {
            continue;
        }
        found.push((path.metadata()?.modified()?, path));
    }
    found.sort();
    Ok(found.pop().map(|(_, p)| p))
}

pub(crate) fn deb_field(deb: &Path, field: &str) -> Result<String> {
    Ok(output(
        Command::new("dpkg-deb").arg("-f").arg(deb).arg(field),
        "dpkg-deb comes with Debian's dpkg package.",
    )?
    .trim()
    .to_string())
}

/// The .deb of `package` (at `version` if given), downloaded with `apt-get download` unless
/// already in `debs`.
fn deb(debs: &Path, package: &str, version: Option<&str>, refresh: bool) -> Result<PathBuf> {
    if !refresh && let Some(path) = cached_deb(debs, package, version)? {
        return Ok(path);
    }
    let spec = match version {
        Some(v) => format!("{package}={v}"),
        None => package.to_string(),
    };
    println!("xtask: apt-get download {spec}");
    output(
        Command::new("apt-get")
            .args(["download", &spec])
            .current_dir(debs),
        &format!(
            "`cargo xtask linux-image` takes the guest kernel, busybox and libquantum from Debian \
             packages with `apt-get download`: it needs apt, Debian's package mirrors (network) and \
             current package lists (run `apt-get update` as root). Offline, put the .deb files \
             ({KERNEL_META} and the linux-image-*-cloud-amd64 it depends on, {BUSYBOX}, \
             {LIBQUANTUM}) in {}.",
            debs.display()
        ),
    )?;
    cached_deb(debs, package, version)?
        .with_context(|| format!("apt-get download {spec} succeeded but left no {package}_*.deb"))
}

/// The real kernel package a meta package depends on: `linux-image-6.1.0-56-cloud-amd64
/// (= 6.1.192-2)` → (name, Some(version)).
fn kernel_dependency(depends: &str) -> Result<(String, Option<String>)> {
    for alt in depends.split([',', '|']) {
        let alt = alt.trim();
        let (name, rest) = alt.split_once(' ').unwrap_or((alt, ""));
        let tail = name.strip_prefix("linux-image-").unwrap_or("");
        if tail.starts_with(|c: char| c.is_ascii_digit()) {
            let version = rest
                .trim()
                .strip_prefix("(=")
                .and_then(|v| v.strip_suffix(')'))
                .map(|v| v.trim().to_string());
            return Ok((name.to_string(), version));
        }
    }
    bail!("{KERNEL_META} depends on \"{depends}\": no linux-image-<version>-... package in it")
}

/// Extracts the members matching `patterns` (tar wildcards) of a .deb's data into `dest`.
pub(crate) fn extract(deb: &Path, dest: &Path, patterns: &[&str]) -> Result<()> {
    std::fs::create_dir_all(dest)?;
    let mut dpkg = Command::new("dpkg-deb")
        .arg("--fsys-tarfile")
        .arg(deb)
        .stdout(Stdio::piped())
        .spawn()
        .context("cannot run dpkg-deb (Debian's dpkg package)")?;
    let stdout = dpkg.stdout.take().context("dpkg-deb stdout")?;
    let tar = Command::new("tar")
        .arg("-x")
        .arg("-C")
        .arg(dest)
        .arg("--wildcards")
        .args(patterns)
        .stdin(stdout)
        .output()
        .context("cannot run tar")?;
    let status = dpkg.wait()?;
    if !tar.status.success() || !status.success() {
        bail!(
            "extracting {} from {} failed: {}",
            patterns.join(" "),
            deb.display(),
            String::from_utf8_lossy(&tar.stderr).trim()
        );
    }
    Ok(())
}

/// The one file matching `prefix*` in `dir`.
fn one_file(dir: &Path, prefix: &str) -> Result<PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(prefix))
        {
            found.push(path);
        }
    }
    match found.len() {
        1 => Ok(found.remove(0)),
        n => bail!(
            "{} holds {n} files named {prefix}*, expected one",
            dir.display()
        ),
    }
}

/// Builds a dynamically linked PIE workload with the host gcc (the guest's libc is the same
/// Debian version as the host's).
fn gcc_pie(out: &Path, sources: &[&Path], extra: &[&str]) -> Result<()> {
    let mut cmd = Command::new("gcc");
    cmd.args(["-fPIE", "-pie", "-O2", "-g", "-Wall", "-o"])
        .arg(out)
        .args(sources)
        .args(extra);
    output(
        &mut cmd,
        "The workloads need the host C compiler: apt-get install gcc libc6-dev.",
    )?;
    Ok(())
}

/// Copies a program into the guest's tree, executable.
fn copy_executable(from: &Path, to: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::copy(from, to)
        .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// Adds the tree under `dir` (at `prefix` in the archive) to the initramfs: folders before what
/// they hold, in name order (the same tree gives the same archive), symbolic links as links;
/// except the folders `leave_out` (paths in the archive).
fn add_tree(fs: &mut Initramfs, dir: &Path, prefix: &str, leave_out: &[&str]) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .collect::<std::io::Result<_>>()?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = e.file_name();
        let name = name
            .to_str()
            .with_context(|| format!("{}: a name that is not UTF-8", e.path().display()))?;
        let path = if prefix.is_empty() {
            name.to_owned()
        } else {
            format!("{prefix}/{name}")
        };
        if leave_out.contains(&path.as_str()) {
            continue;
        }
        let meta = std::fs::symlink_metadata(e.path())?;
        if meta.file_type().is_symlink() {
            let target = std::fs::read_link(e.path())?;
            fs.symlink(&path, &target.to_string_lossy())?;
        } else if meta.is_dir() {
            fs.dir(&path)?;
            add_tree(fs, &e.path(), &path, leave_out)?;
        } else {
            fs.file(&path, meta.permissions().mode(), std::fs::read(e.path())?)?;
        }
    }
    Ok(())
}

/// An ELF file's GNU build id, in hex.
fn build_id(path: &Path) -> Result<String> {
    use object::Object;
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let elf = object::File::parse(&*bytes).with_context(|| format!("{}", path.display()))?;
    let id = elf
        .build_id()
        .ok()
        .flatten()
        .with_context(|| format!("{} has no build id", path.display()))?;
    Ok(id.iter().map(|b| format!("{b:02x}")).collect())
}

/// Builds a static, non-PIE workload with the host gcc.
fn gcc(out: &Path, sources: &[&Path], extra: &[&str]) -> Result<()> {
    let mut cmd = Command::new("gcc");
    cmd.args(["-static", "-no-pie", "-O2", "-g", "-Wall", "-o"])
        .arg(out)
        .args(sources)
        .args(extra);
    output(
        &mut cmd,
        "The workloads need the host C compiler and static libraries: \
         apt-get install gcc libc6-dev (libgomp.a comes with gcc's libgcc-12-dev).",
    )?;
    Ok(())
}

fn size(path: &Path) -> Result<u64> {
    Ok(std::fs::metadata(path)
        .with_context(|| format!("{}", path.display()))?
        .len())
}

/// `cargo xtask linux-image [--refresh]`.
pub fn image(refresh: bool) -> Result<()> {
    let started = Instant::now();
    let dir = linux_dir();
    let debs = dir.join("debs");
    std::fs::create_dir_all(&debs)?;

    // The packages: the meta package names the real kernel package and its exact version.
    let meta = deb(&debs, KERNEL_META, None, refresh)?;
    let meta_version = deb_field(&meta, "Version")?;
    let (kernel_pkg, kernel_version) = kernel_dependency(&deb_field(&meta, "Depends")?)?;
    let kernel_deb = deb(&debs, &kernel_pkg, kernel_version.as_deref(), refresh)?;
    let busybox_deb = deb(&debs, BUSYBOX, None, refresh)?;
    let quantum_deb = deb(&debs, LIBQUANTUM, None, refresh)?;

    // The libraries and the dynamic programs' packages (the guest's /lib and /usr/lib).
    let libc_deb = deb(&debs, LIBC, None, refresh)?;
    let libc_debug_deb = deb(
        &debs,
        LIBC_DEBUG,
        Some(&deb_field(&libc_deb, "Version")?),
        refresh,
    )?;
    let gomp_deb = deb(&debs, LIBGOMP, None, refresh)?;
    let quantum_so_deb = deb(&debs, LIBQUANTUM_SO, None, refresh)?;
    let busybox_pie_deb = deb(&debs, BUSYBOX_PIE, None, refresh)?;

    let extract_dir = dir.join("extract");
    if extract_dir.exists() {
        std::fs::remove_dir_all(&extract_dir)?;
    }
    extract(
        &kernel_deb,
        &extract_dir,
        &["./boot/vmlinuz-*", "./boot/config-*"],
    )?;
    extract(&busybox_deb, &extract_dir, &["./bin/busybox"])?;
    extract(
        &quantum_deb,
        &extract_dir,
        &[
            "./usr/include/quantum.h",
            "./usr/lib/x86_64-linux-gnu/libquantum.a",
        ],
    )?;

    // The guest's file tree: the initramfs is made of it, and it is what `--guest-root` gives
    // the analyzer (the files the guest's processes map, at the same paths).
    let root = dir.join("root");
    if root.exists() {
        std::fs::remove_dir_all(&root)?;
    }
    std::fs::create_dir_all(&root)?;
    let modules: Vec<String> = MODULES
        .iter()
        .map(|m| format!("./lib/modules/*/{m}"))
        .collect();
    extract(
        &kernel_deb,
        &root,
        &modules.iter().map(String::as_str).collect::<Vec<_>>(),
    )?;
    extract(
        &libc_deb,
        &root,
        &[
            "./lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
            "./lib/x86_64-linux-gnu/libc.so.6",
            "./lib/x86_64-linux-gnu/libm.so.6",
            "./lib/x86_64-linux-gnu/libresolv.so.2",
            "./lib64/ld-linux-x86-64.so.2",
        ],
    )?;
    extract(
        &gomp_deb,
        &root,
        &["./usr/lib/x86_64-linux-gnu/libgomp.so.1*"],
    )?;
    extract(
        &quantum_so_deb,
        &root,
        &["./usr/lib/x86_64-linux-gnu/libquantum.so.8*"],
    )?;
    // libc's debug file, at the GNU build-id path under /usr/lib/debug (its symbols name libc's
    // internal functions, which the stripped library's dynamic symbols do not).
    let libc_id = build_id(&root.join("lib/x86_64-linux-gnu/libc.so.6"))?;
    let debug_file = format!(
        "./usr/lib/debug/.build-id/{}/{}.debug",
        &libc_id[..2],
        &libc_id[2..]
    );
    extract(&libc_debug_deb, &root, &[&debug_file]).with_context(|| {
        format!("{LIBC_DEBUG} has no debug file for libc.so.6 (build id {libc_id})")
    })?;
    // Debian's dynamically linked busybox (a PIE), beside the static one /init runs on.
    let pie = extract_dir.join("pie");
    extract(&busybox_pie_deb, &pie, &["./bin/busybox"])?;
    std::fs::create_dir_all(root.join("usr/bin"))?;
    copy_executable(&pie.join("bin/busybox"), &root.join("usr/bin/busybox"))?;

    // The kernel, its decompressed ELF and what the profiler reads from it.
    let boot = extract_dir.join("boot");
    let bzimage = dir.join("bzImage");
    replace_file(&bzimage, &std::fs::read(one_file(&boot, "vmlinuz-")?)?)?;
    replace_file(
        &dir.join("config"),
        &std::fs::read(one_file(&boot, "config-")?)?,
    )?;
    let bz_bytes = std::fs::read(&bzimage)?;
    let bz = BzImage::parse(&bz_bytes).context("the downloaded kernel")?;
    let vmlinux_bytes = bz.vmlinux().context("the downloaded kernel")?;
    let vmlinux = dir.join("vmlinux");
    replace_file(&vmlinux, &vmlinux_bytes)?;
    let kernel = KernelImage::from_vmlinux_bytes(&vmlinux_bytes).context("target/linux/vmlinux")?;
    drop(vmlinux_bytes);

    // The workloads: static non-PIE programs, and dynamic PIE ones against the guest's libraries.
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin)?;
    let src = guest_src();
    gcc(&bin.join("w41"), &[&src.join("w41.c")], &[])?;
    // The same with frame pointers, for the call-chain scenario (`stacks=`: perf's
    // `--call-graph fp` needs them too), in its leaf functions as well (`LEAF_FRAME`: without a
    // record of its own a leaf hides its caller).
    gcc(
        &bin.join("w41-fp"),
        &[&src.join("w41.c")],
        &["-fno-omit-frame-pointer", "-DLEAF_FRAME"],
    )?;
    // System calls with a known kernel path, for kernel call chains (also frame pointers).
    gcc(
        &bin.join("zeroread"),
        &[&src.join("zeroread.c")],
        &["-fno-omit-frame-pointer"],
    )?;
    gcc(&bin.join("hvexit"), &[&src.join("hvexit.c")], &[])?;
    // The runner of `cargo xtask profile`'s command (argv, environment and directory exactly).
    gcc(&bin.join("hvrun"), &[&src.join("hvrun.c")], &[])?;
    // Two threads taking turns at a spinlock, for lock-holder preemption.
    gcc(
        &bin.join("lockholder"),
        &[&src.join("lockholder.c")],
        &["-pthread"],
    )?;
    // A thread whose page-table changes need TLB shootdowns of its sibling's CPU, for
    // pause-loop exiting (the kernel spins at CPL 0 for the IPI).
    gcc(
        &bin.join("shootdown"),
        &[&src.join("shootdown.c")],
        &["-pthread"],
    )?;
    let q = extract_dir.join("usr");
    let include = format!("-I{}", q.join("include").display());
    let libquantum = q.join("lib/x86_64-linux-gnu/libquantum.a");
    gcc(
        &bin.join("shor"),
        &[&src.join("shor.c"), &libquantum],
        &[&include, "-fopenmp", "-lm"],
    )
    .context("building shor (libquantum.a is built with OpenMP: it links libgomp.a statically)")?;
    let guest_libs = format!("-L{}", root.join("usr/lib/x86_64-linux-gnu").display());
    gcc_pie(
        &bin.join("shor-dyn"),
        &[&src.join("shor.c")],
        &[
            &include,
            &guest_libs,
            "-l:libquantum.so.8",
            "-fopenmp",
            "-lm",
        ],
    )
    .context("building shor-dyn (against Debian's libquantum.so.8)")?;
    gcc_pie(&bin.join("hashload"), &[&src.join("hashload.c")], &[])?;

    // The rest of the tree: /init, busybox, the workloads.
    for d in ["bin", "dev", "proc", "sys", "tmp", "root"] {
        std::fs::create_dir_all(root.join(d))?;
    }
    copy_executable(&src.join("init"), &root.join("init"))?;
    copy_executable(&extract_dir.join("bin/busybox"), &root.join("bin/busybox"))?;
    std::os::unix::fs::symlink("busybox", root.join("bin/sh"))?;
    for name in GUEST_PROGRAMS {
        copy_executable(&bin.join(name), &root.join("bin").join(name))?;
    }

    // The initramfs.
    let mut fs = Initramfs::new();
    add_tree(&mut fs, &root, "", &[DEBUG_DIR])?;
    fs.char_dev("dev/console", 0o600, 5, 1)?;
    let initramfs = dir.join("initramfs.cpio.gz");
    replace_file(&initramfs, &fs.to_gzip()?)?;
    // Uncompressed too: under an instruction-counting emulator, gunzip of the initramfs costs
    // the guest about 300 M instructions at boot.
    replace_file(&dir.join("initramfs.cpio"), &fs.to_cpio()?)?;
    std::fs::remove_dir_all(&extract_dir)?;

    // The manifest.
    let h = &bz.header;
    let entry = kernel.entry_syscall_64()?;
    let mut files = serde_json::Map::new();
    for name in [
        "bzImage",
        "vmlinux",
        "initramfs.cpio.gz",
        "initramfs.cpio",
        "config",
        "bin/w41",
        "bin/w41-fp",
        "bin/zeroread",
        "bin/shor",
        "bin/hvexit",
        "bin/hvrun",
        "bin/shor-dyn",
        "bin/hashload",
        "bin/lockholder",
        "bin/shootdown",
    ] {
        files.insert(name.into(), json!(size(&dir.join(name))?));
    }
    let manifest = json!({
        "kernel_package": kernel_pkg,
        "kernel_package_version": kernel_version,
        "meta_package": format!("{KERNEL_META} {meta_version}"),
        "kernel_release": kernel.release(),
        "banner": kernel.banner,
        "build_id": kernel.build_id,
        "busybox": deb_field(&busybox_deb, "Version")?,
        "libquantum": deb_field(&quantum_deb, "Version")?,
        "libquantum_so": deb_field(&quantum_so_deb, "Version")?,
        "libc": deb_field(&libc_deb, "Version")?,
        "libgomp": deb_field(&gomp_deb, "Version")?,
        "busybox_pie": deb_field(&busybox_pie_deb, "Version")?,
        "libc_build_id": libc_id,
        "modules": MODULES,
        "compression": format!("{:?}", bz.compression),
        "setup_header": h,
        "entry_64_offset": linux_guest::bzimage::ENTRY_64_OFFSET,
        "symbols": kernel.symbols.symbols().len(),
        "entry_SYSCALL_64": format!("{entry:#x}"),
        "kallsyms_layout": kernel.symbols.layout(),
        "task_offsets": kernel.offsets,
        "task_offsets_compact": kernel.offsets.to_compact(),
        // The hypervisor's `mm-layout=`, `module-layout=` and `orc-layout=` for this kernel (docs/GUEST-ABI.md),
        // or why they could not be derived.
        "mm_layout": kernel.mm_layout.as_ref().map(ToString::to_string).unwrap_or_else(|e| format!("unavailable: {e}")),
        "module_layout": kernel.module_layout.as_ref().map(ToString::to_string).unwrap_or_else(|e| format!("unavailable: {e}")),
        "orc_layout": kernel.orc_layout.as_ref().map(ToString::to_string).unwrap_or_else(|e| format!("unavailable: {e}")),
        "workloads": WORKLOADS.iter().map(|(n, a)| (n.to_string(), json!(a))).collect::<serde_json::Map<_, _>>(),
        "cmdline": format!("{BASE_CMDLINE} hvprof.run=w41 hvprof.arg=400"),
        "files": files,
    });
    let manifest_path = dir.join("manifest.json");
    replace_file(
        &manifest_path,
        (serde_json::to_string_pretty(&manifest)? + "\n").as_bytes(),
    )?;

    println!(
        "kernel: {} ({kernel_pkg} {}), {:?} payload",
        kernel.release().unwrap_or("?"),
        kernel_version.as_deref().unwrap_or("?"),
        bz.compression
    );
    println!("{bz}");
    println!(
        "vmlinux: {} symbols from kallsyms, entry_SYSCALL_64 {entry:#x}, task offsets {}",
        kernel.symbols.symbols().len(),
        kernel.offsets
    );
    for (name, bytes) in &files {
        println!("  {:<20} {:>10} bytes", name, bytes);
    }
    println!(
        "{} ({:.1} s)",
        manifest_path.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `cargo xtask linux-truth`: the native ground truth of each workload's function shares.
/// Where `truth` writes the ground truth.
pub fn truth_path() -> PathBuf {
    linux_dir().join("truth.json")
}

/// Whether the ground truth exists and holds everything the scenarios compare with (a truth
/// written by an older version lacks the native kernel share).
pub fn truth_is_current() -> bool {
    let Ok(bytes) = std::fs::read(truth_path()) else {
        return false;
    };
    let Ok(doc) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
        return false;
    };
    // Where perf could not run, the truth says so (an "error") and is as complete as it can be.
    (doc.pointer("/workloads/error").is_some()
        || doc.pointer("/workloads/w41/kernel_share").is_some())
        && doc.pointer("/instructions/shor-dyn").is_some()
}

pub fn truth() -> Result<()> {
    let dir = linux_dir();
    let bin = dir.join("bin");
    if GUEST_PROGRAMS.iter().any(|p| !bin.join(p).exists()) {
        image(false)?;
    }
    // Native cpu-clock sampling where perf can run here; the instruction counts always (they are
    // the truth for Bochs, whose clock counts instructions).
    let (version, results) = match perf_truth(&dir) {
        Ok((version, results)) => (version, serde_json::Value::Object(results)),
        Err(e) => {
            eprintln!("xtask: no perf ground truth here: {e:#}");
            (String::new(), json!({ "error": format!("{e:#}") }))
        }
    };
    let instructions = match instruction_truth(&dir) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("xtask: no instruction-count truth: {e:#}");
            json!({ "error": format!("{e:#}") })
        }
    };
    let path = dir.join("truth.json");
    let doc = json!({
        "perf": version,
        "workloads": results,
        "instructions": instructions,
    });
    replace_file(
        &path,
        (serde_json::to_string_pretty(&doc)? + "\n").as_bytes(),
    )?;
    println!("{}", path.display());
    Ok(())
}

/// `perf record -e cpu-clock` of each workload on the host: (perf's version, per workload the
/// function shares and the commands).
fn perf_truth(dir: &Path) -> Result<(String, serde_json::Map<String, serde_json::Value>)> {
    let perf_hint = "perf comes with Debian's linux-perf package (apt-get install linux-perf); \
                     `-e cpu-clock` is a software event, so it needs no hardware counters, but \
                     /proc/sys/kernel/perf_event_paranoid must allow it (run as root or set it \
                     to 1 or less).";
    let version = output(Command::new("perf").arg("--version"), perf_hint)?;
    let bin = dir.join("bin");
    let mut results = serde_json::Map::new();
    for (name, args) in TRUTH_ARGS {
        let data = dir.join(format!("perf-{name}.data"));
        let exe = bin.join(name);
        let mut record = Command::new("perf");
        record
            .args(["record", "-e", "cpu-clock", "-o"])
            .arg(&data)
            .arg("--")
            .arg(&exe)
            .args(args)
            .env("OMP_NUM_THREADS", "1");
        let record_shown = format!(
            "OMP_NUM_THREADS=1 perf record -e cpu-clock -o {} -- {} {}",
            data.display(),
            exe.display(),
            args.join(" ")
        );
        println!("xtask: {record_shown}");
        output(&mut record, perf_hint)?;
        let mut report = Command::new("perf");
        report
            .args([
                "report",
                "--stdio",
                "--no-children",
                "-n",
                "--sort",
                "sym",
                "-q",
                "-i",
            ])
            .arg(&data);
        let report_shown = format!(
            "perf report --stdio --no-children -n --sort sym -q -i {}",
            data.display()
        );
        let text = output(&mut report, perf_hint)?;
        let rows = parse_report(&text);
        if rows.is_empty() {
            bail!("{report_shown} printed no samples:\n{text}");
        }
        // The share of the process's samples in the kernel (system calls, page faults, the
        // timer tick): what the same workload costs the kernel natively.
        let mut dso = Command::new("perf");
        dso.args([
            "report",
            "--stdio",
            "--no-children",
            "--sort",
            "dso",
            "-q",
            "-i",
        ])
        .arg(&data);
        let dso_shown = format!(
            "perf report --stdio --no-children --sort dso -q -i {}",
            data.display()
        );
        let kernel_share: f64 = output(&mut dso, perf_hint)?
            .lines()
            .filter(|l| l.contains("[kernel.kallsyms]"))
            .filter_map(|l| {
                l.split_whitespace()
                    .next()?
                    .trim_end_matches('%')
                    .parse::<f64>()
                    .ok()
            })
            .sum::<f64>();
        let samples: u64 = rows.iter().map(|r| r.1).sum();
        println!("{name}: {samples} samples, {kernel_share:.2}% in the kernel");
        for (share, n, sym) in rows.iter().take(6) {
            println!("  {share:6.2}% {n:>7}  {sym}");
        }
        results.insert(
            name.to_string(),
            json!({
                "command": record_shown,
                "report_command": report_shown,
                "samples": samples,
                "kernel_share": kernel_share,
                "kernel_share_command": dso_shown,
                "functions": rows.iter().map(|(share, n, sym)| json!({"symbol": sym, "share": share, "samples": n})).collect::<Vec<_>>(),
            }),
        );
    }
    Ok((version.trim().to_owned(), results))
}

/// Instruction counts per function of each workload with its guest arguments, from valgrind's
/// callgrind: the truth to compare with where the sampling clock counts instructions (Bochs,
/// where one TSC tick is one instruction). cpu-clock shares differ where the work is memory-bound.
fn instruction_truth(dir: &Path) -> Result<serde_json::Value> {
    let hint = "valgrind comes with Debian's valgrind package (apt-get install valgrind).";
    let mut results = serde_json::Map::new();
    for (name, args) in WORKLOADS
        .iter()
        .filter(|(n, _)| INSTRUCTION_TRUTH.contains(n))
    {
        let out = dir.join(format!("callgrind-{name}.out"));
        let exe = dir.join("bin").join(name);
        let args: Vec<&str> = args.split(',').collect();
        // The dynamic programs run against the guest's libquantum.so.8 (the host has none;
        // libc and libgomp are the host's, the same Debian versions as the guest's).
        let libs = dir.join("root/usr/lib/x86_64-linux-gnu");
        let shown = format!(
            "OMP_NUM_THREADS=1 LD_LIBRARY_PATH={} valgrind --tool=callgrind --callgrind-out-file={} {} {}",
            libs.display(),
            out.display(),
            exe.display(),
            args.join(" ")
        );
        println!("xtask: {shown}");
        output(
            Command::new("valgrind")
                .arg("--tool=callgrind")
                .arg(format!("--callgrind-out-file={}", out.display()))
                .arg(&exe)
                .args(&args)
                .env("OMP_NUM_THREADS", "1")
                .env("LD_LIBRARY_PATH", &libs),
            hint,
        )?;
        let text = output(
            Command::new("callgrind_annotate")
                .args(["--threshold=100", "--auto=no"])
                .arg(&out),
            hint,
        )?;
        let (total, rows) = parse_callgrind(&text);
        if total == 0 || rows.is_empty() {
            bail!("callgrind_annotate {} printed no counts", out.display());
        }
        println!("{name}: {total} instructions");
        for (share, n, sym) in rows.iter().take(6) {
            println!("  {share:6.2}% {n:>11}  {sym}");
        }
        results.insert(
            name.to_string(),
            json!({
                "command": shown,
                "instructions": total,
                "functions": rows.iter().map(|(share, n, sym)| json!({"symbol": sym, "share": share, "instructions": n})).collect::<Vec<_>>(),
            }),
        );
    }
    Ok(serde_json::Value::Object(results))
}

/// `callgrind_annotate` rows `301,807,996 (56.24%)  ???:quantum_toffoli._omp_fn.0 [/path]`:
/// the program total and (percent, instructions, function).
pub(crate) fn parse_callgrind(text: &str) -> (u64, Vec<(f64, u64, String)>) {
    let mut total = 0;
    let mut rows = Vec::new();
    for line in text.lines() {
        // The share is "(56.24%)" or "( 6.87%)".
        let Some((count, rest)) = line.split_once('(') else {
            continue;
        };
        let Some((share, what)) = rest.split_once("%)") else {
            continue;
        };
        let (Ok(count), Ok(share)) = (
            count.trim().replace(',', "").parse::<u64>(),
            share.trim().parse::<f64>(),
        ) else {
            continue;
        };
        let Some(what) = what.split_whitespace().next() else {
            continue;
        };
        if what == "PROGRAM" {
            total = count;
        } else {
            let function = what.rsplit_once(':').map_or(what, |(_, f)| f);
            rows.push((share, count, function.to_string()));
        }
    }
    (total, rows)
}

/// `perf report --stdio -n --sort sym -q` rows: (percent, samples, symbol).
fn parse_report(text: &str) -> Vec<(f64, u64, String)> {
    text.lines()
        .filter_map(|line| {
            let mut it = line.split_whitespace();
            let share = it.next()?.strip_suffix('%')?.parse().ok()?;
            let samples = it.next()?.parse().ok()?;
            let _level = it.next()?; // [.] user, [k] kernel
            let sym = it.collect::<Vec<_>>().join(" ");
            (!sym.is_empty()).then_some((share, samples, sym))
        })
        .collect()
}

/// `cargo xtask linux-qemu`: boots the kernel and initramfs in QEMU TCG (no VMX: the guest runs
/// directly, without the hypervisor) to check them and time boot and workload.
pub fn qemu(run: &str, arg: Option<&str>, timeout: u64) -> Result<ExitCode> {
    let dir = linux_dir();
    let (bzimage, initramfs) = (dir.join("bzImage"), dir.join("initramfs.cpio.gz"));
    if !bzimage.exists() || !initramfs.exists() {
        image(false)?;
    }
    let arg = arg.map(str::to_string).or_else(|| {
        WORKLOADS
            .iter()
            .find(|w| w.0 == run)
            .map(|w| w.1.to_string())
    });
    let mut cmdline = format!("{BASE_CMDLINE} hvprof.run={run}");
    if let Some(a) = &arg {
        cmdline += &format!(" hvprof.arg={a}");
    }
    let log_path = dir.join(format!("qemu-{run}.log"));
    let mut log = std::fs::File::create(&log_path)?;
    let mut cmd = Command::new("qemu-system-x86_64");
    cmd.args(["-accel", "tcg", "-m", "512", "-smp", "1", "-no-reboot"])
        .args(["-display", "none", "-monitor", "none", "-serial", "stdio"])
        .args(["-device", "isa-debug-exit,iobase=0xf4,iosize=0x04"])
        .arg("-kernel")
        .arg(&bzimage)
        .arg("-initrd")
        .arg(&initramfs)
        .arg("-append")
        .arg(&cmdline)
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    println!("xtask: qemu-system-x86_64 (TCG) -append \"{cmdline}\"");
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .context("cannot run qemu-system-x86_64 (Debian package qemu-system-x86)")?;
    let stdout = child.stdout.take().context("qemu stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send((start.elapsed(), line)).is_err() {
                break;
            }
        }
    });
    let (mut started, mut done, mut rc) = (None, None, None);
    let deadline = Duration::from_secs(timeout);
    loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok((t, line)) => {
                writeln!(log, "[{:8.3}] {line}", t.as_secs_f64())?;
                if line.contains("hvprof-guest: start") {
                    started = Some(t);
                } else if line.contains("hvprof-guest: done") {
                    done = Some(t);
                    rc = line
                        .rsplit("rc=")
                        .next()
                        .and_then(|v| v.trim().parse::<u8>().ok());
                }
                if line.contains("hvprof-guest: out") || line.contains("hvprof-guest: error") {
                    println!("  {}", line.trim());
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
        }
        if start.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "QEMU did not finish in {timeout} s (log: {})",
                log_path.display()
            );
        }
    }
    let status = child.wait()?;
    let total = start.elapsed();
    // isa-debug-exit: QEMU exits with (value << 1) | 1.
    let guest_exit = status.code().filter(|c| c & 1 == 1).map(|c| c >> 1);
    let secs =
        |d: Option<Duration>| d.map_or("-".to_string(), |d| format!("{:.2} s", d.as_secs_f64()));
    println!(
        "start marker at {}, done marker at {}, workload {}, QEMU exit after {:.2} s, guest exit value {:?} (log: {})",
        secs(started),
        secs(done),
        match (started, done) {
            (Some(a), Some(b)) => format!("{:.2} s", (b - a).as_secs_f64()),
            _ => "-".into(),
        },
        total.as_secs_f64(),
        guest_exit,
        log_path.display()
    );
    if started.is_none() || done.is_none() || rc != Some(0) || guest_exit != Some(0) {
        eprintln!("xtask: the guest run did not complete cleanly (see the log)");
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_dependency_takes_the_versioned_image_package() {
        let (name, version) =
            kernel_dependency("linux-image-6.1.0-56-cloud-amd64 (= 6.1.192-2)").unwrap();
        assert_eq!(name, "linux-image-6.1.0-56-cloud-amd64");
        assert_eq!(version.as_deref(), Some("6.1.192-2"));
        let (name, version) = kernel_dependency(
            "initramfs-tools | linux-initramfs-tool, linux-image-6.12.9-cloud-amd64",
        )
        .unwrap();
        assert_eq!(
            (name.as_str(), version),
            ("linux-image-6.12.9-cloud-amd64", None)
        );
        let e = kernel_dependency("linux-image-cloud-amd64-unsigned")
            .unwrap_err()
            .to_string();
        assert!(e.contains("no linux-image-<version>"), "{e}");
    }

    #[test]
    fn perf_report_rows_are_parsed() {
        let text = "    80.70%          3228  [.] work_a\n    18.90%  756  [.] work_b\n     0.40%  16  [k] clear_page_erms\n\n# comment\n";
        let rows = parse_report(text);
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0], (80.70, 3228, "work_a".to_string()));
        assert_eq!(rows[2].2, "clear_page_erms");
    }

    #[test]
    fn callgrind_rows_are_parsed() {
        let text = "Ir\n--\n536,612,160 (100.0%)  PROGRAM TOTALS\n\n301,807,996 (56.24%)  ???:quantum_toffoli._omp_fn.0 [/t/shor]\n 70,128,128 (13.07%)  ???:quantum_cnot._omp_fn.0 [/t/shor]\n  5,354,806 ( 1.00%)  ???:quantum_gate1 [/t/shor]\n";
        let (total, rows) = parse_callgrind(text);
        assert_eq!(total, 536_612_160);
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[2], (1.0, 5_354_806, "quantum_gate1".to_string()));
        assert_eq!(
            rows[0],
            (56.24, 301_807_996, "quantum_toffoli._omp_fn.0".to_string())
        );
    }
}
