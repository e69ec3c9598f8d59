//! Links every guest with `linker.ld` (one loadable segment at 2 MiB, physical = virtual), as a
//! non-PIE `ET_EXEC`, with a GNU build id (the analyzer matches guest images by it).
fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    println!("cargo:rerun-if-changed=linker.ld");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-link-arg-bins=-T{dir}/linker.ld");
    println!("cargo:rustc-link-arg-bins=--build-id=sha1");
    println!("cargo:rustc-link-arg-bins=--no-pie");
}
