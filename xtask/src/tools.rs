//! Making sure the emulators and ISO tools are installed.

use std::process::Command;

use anyhow::{Context, Result, bail};
use qemu_tests::tools::{APT_PACKAGES, missing, which};

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn install_command(sudo: bool) -> String {
    let sudo = if sudo { "sudo " } else { "" };
    format!(
        "{sudo}apt-get update && {sudo}env DEBIAN_FRONTEND=noninteractive apt-get install -y \
         --no-install-recommends {}",
        APT_PACKAGES.join(" ")
    )
}

fn run_apt(args: &[&str]) -> Result<()> {
    let status = Command::new("apt-get")
        .args(args)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .with_context(|| format!("cannot run apt-get {}", args.join(" ")))?;
    if !status.success() {
        bail!("apt-get {} failed ({status})", args.join(" "));
    }
    Ok(())
}

/// Checks for every tool the ISO and the emulators need, and installs the Debian packages when
/// something is missing and we may (root with apt-get); otherwise says what to run.
pub fn ensure_tools() -> Result<()> {
    let missing_now = missing();
    if missing_now.is_empty() {
        return Ok(());
    }
    eprintln!("xtask: missing tools:");
    for (what, package) in &missing_now {
        eprintln!("  {what} (package {package})");
    }
    if !is_root() {
        eprintln!("xtask: install them with:\n  {}", install_command(true));
        bail!("missing tools (see above)");
    }
    if which("apt-get").is_none() {
        bail!(
            "missing tools and no apt-get: install the equivalents of the Debian packages {}",
            APT_PACKAGES.join(" ")
        );
    }
    eprintln!("xtask: installing: {}", install_command(false));
    run_apt(&["update"])?;
    let mut args = vec!["install", "-y", "--no-install-recommends"];
    args.extend_from_slice(APT_PACKAGES);
    run_apt(&args)?;
    let still = missing();
    if !still.is_empty() {
        let names: Vec<String> = still.into_iter().map(|(what, _)| what).collect();
        bail!("still missing after apt-get install: {}", names.join(", "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn install_command_names_bochs_term_and_no_recommends() {
        let cmd = install_command(true);
        assert!(cmd.starts_with("sudo apt-get update && sudo env DEBIAN_FRONTEND=noninteractive"));
        assert!(cmd.contains("--no-install-recommends"));
        assert!(cmd.contains(" bochs bochs-term "));
        assert!(cmd.contains(" ovmf"));
    }
}
