//! The analyzer's integration tests, in one test binary: each module was a binary of its own,
//! and each linked the whole analyzer again (some 35-90 MB apiece, and the time to link it).
//!
//! `cargo test -p hvprof-analyze --test integration [FILTER]`; a module's tests by its name, e.g.
//! `cargo test -p hvprof-analyze --test integration exports::`.

mod diff;
mod exports;
mod html;
mod integrity;
mod live;
mod losses;
mod pipes;
mod preemption;
mod scaling;
mod stacks;
mod steal;
mod terminal;
mod window;

/// A fixture in `tests/data`: end-to-end captures and symbol-only copies of the ELF files that
/// made them.
fn data(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}
