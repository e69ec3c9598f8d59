//! Rules about the hypervisor's code that its tests enforce by reading it (as `modgraph` does
//! for its imports): an exit handler prints only through `vm_report!`, the per-VM rate-limited
//! path that never waits for the console (docs/SECURITY.md, "ACPI PM1"), so that no guest can
//! flood the console or stall another VM's exits by causing lines.

#[cfg(test)]
mod tests {
    use std::fs;
    use std::path::{Path, PathBuf};

    /// The `.rs` files under `dir`, recursively.
    fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in fs::read_dir(dir).unwrap_or_else(|e| panic!("{dir:?}: {e}")) {
            let path = entry.unwrap().path();
            if path.is_dir() {
                rust_files(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }

    /// The lines of `src` that print to the console directly (`println!`, `print!`), outside
    /// comments: (line number, line).
    fn direct_prints(src: &str) -> Vec<(usize, String)> {
        src.lines()
            .enumerate()
            .filter(|(_, l)| !l.trim_start().starts_with("//"))
            .filter(|(_, l)| {
                let code = l.split("//").next().unwrap_or("");
                ["println!", "print!"].iter().any(|m| {
                    code.match_indices(m).any(|(i, _)| {
                        // Not the tail of another macro's name (`vm_println!`, `eprint!`).
                        i == 0 || {
                            let c = code.as_bytes()[i - 1];
                            !(c.is_ascii_alphanumeric() || c == b'_')
                        }
                    })
                })
            })
            .map(|(i, l)| (i + 1, l.trim().to_string()))
            .collect()
    }

    #[test]
    fn direct_prints_are_found_and_comments_and_vm_report_are_not() {
        let src = "// println!(\"no\")\nvm_report!(vm, \"x\");\n    crate::println!(\"vm {}\", n); // yes\nlet s = x; // print!(\"no\")\n";
        assert_eq!(
            direct_prints(src),
            vec![(3, "crate::println!(\"vm {}\", n); // yes".to_string())]
        );
    }

    /// Exit handlers and the device paths a guest drives print only through `vm_report!`.
    #[test]
    fn handlers_print_through_vm_report() {
        let hv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../hypervisor/src");
        let mut files = Vec::new();
        rust_files(&hv.join("bin/hvprof/vmexit"), &mut files);
        rust_files(&hv.join("devices"), &mut files);
        for file in [
            "virtual_interrupts.rs",
            "apic_bus.rs",
            "virtual_apic.rs",
            "linux_tasks.rs",
        ] {
            files.push(hv.join("bin/hvprof/vm").join(file));
        }
        assert!(files.len() > 10, "{} files", files.len());
        let mut found = Vec::new();
        for f in &files {
            let src = fs::read_to_string(f).unwrap_or_else(|e| panic!("{f:?}: {e}"));
            for (n, line) in direct_prints(&src) {
                found.push(format!("{}:{n}: {line}", f.display()));
            }
        }
        assert!(
            found.is_empty(),
            "exit handlers print only through vm_report! (rate-limited per VM, never waiting for the console):\n{}",
            found.join("\n")
        );
    }
}
