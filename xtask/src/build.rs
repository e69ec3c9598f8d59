//! Building the hypervisor.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{target_dir, workspace_root};

/// The bare-metal target.
pub const TARGET: &str = "x86_64-unknown-none";

/// `cargo`, as the one that started us (`CARGO`), else from PATH.
pub fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(workspace_root());
    cmd
}

/// Adds the bare-metal Rust target when it is missing (`RUSTUP_AUTO_INSTALL=0` machines do not
/// add it by themselves).
pub fn ensure_rust_target() -> Result<()> {
    let listed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .current_dir(workspace_root())
        .output();
    let output = match listed {
        Ok(output) if output.status.success() => output,
        Ok(output) => bail!(
            "rustup target list --installed failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ),
        Err(e) => {
            eprintln!("xtask: note: cannot run rustup ({e}); assuming {TARGET} is installed");
            return Ok(());
        }
    };
    let installed = String::from_utf8_lossy(&output.stdout);
    if installed.lines().any(|line| line.trim() == TARGET) {
        return Ok(());
    }
    eprintln!("xtask: adding the Rust target {TARGET}");
    let status = Command::new("rustup")
        .args(["target", "add", TARGET])
        .current_dir(workspace_root())
        .status()
        .context("cannot run rustup target add")?;
    if !status.success() {
        bail!("rustup target add {TARGET} failed ({status})");
    }
    Ok(())
}

/// Where the hypervisor ELF of a profile lands.
pub fn hypervisor_path(debug: bool) -> PathBuf {
    target_dir()
        .join(TARGET)
        .join(if debug { "debug" } else { "release" })
        .join("hvprof")
}

/// Where `build_hypervisor` leaves the test guests: beside the hypervisor's ELF.
pub fn guest_dir(hypervisor: &std::path::Path) -> PathBuf {
    hypervisor.parent().map(PathBuf::from).unwrap_or_default()
}

/// Builds the hypervisor and the test guests (`guests/`, next to it in the same folder); returns
/// the hypervisor's ELF.
pub fn build_hypervisor(debug: bool) -> Result<PathBuf> {
    ensure_rust_target()?;
    let mut cmd = cargo();
    cmd.args([
        "build",
        "-p",
        "hvprof-hypervisor",
        "-p",
        "hvprof-guests",
        "--target",
        TARGET,
    ]);
    if !debug {
        cmd.arg("--release");
    }
    let status = cmd.status().context("cannot run cargo build")?;
    if !status.success() {
        bail!("building the hypervisor failed ({status})");
    }
    let path = hypervisor_path(debug);
    if !path.is_file() {
        bail!("cargo build succeeded but {} is missing", path.display());
    }
    Ok(path)
}

/// Builds `hvprof-analyze` (release) and returns its path.
pub fn build_analyzer() -> Result<PathBuf> {
    let status = cargo()
        .args(["build", "--release", "-p", "hvprof-analyze"])
        .status()
        .context("cannot run cargo build")?;
    if !status.success() {
        bail!("building hvprof-analyze failed ({status})");
    }
    let path = target_dir().join("release").join("hvprof-analyze");
    if !path.is_file() {
        bail!("cargo build succeeded but {} is missing", path.display());
    }
    Ok(path)
}
