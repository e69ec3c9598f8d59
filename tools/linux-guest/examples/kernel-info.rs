//! Prints what `KernelImage` finds in a vmlinux or bzImage:
//! `cargo run -p linux-guest --example kernel-info -- target/linux/vmlinux [NAME...]`.

use linux_guest::KernelImage;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .ok_or("usage: kernel-info VMLINUX|BZIMAGE [SYMBOL...]")?;
    let start = std::time::Instant::now();
    let k = match KernelImage::from_vmlinux(&path) {
        Ok(k) => k,
        Err(linux_guest::Error::Elf(_)) => KernelImage::from_bzimage(&path)?,
        Err(e) => return Err(e.into()),
    };
    println!("{}", k.banner.as_deref().unwrap_or("(no banner)"));
    println!("build id {}", k.build_id.as_deref().unwrap_or("?"));
    println!(
        "{} symbols ({} per-CPU), decoded in {:.2?}",
        k.symbols.symbols().len(),
        k.symbols.percpu_symbols().len(),
        start.elapsed()
    );
    println!("layout {:#x?}", k.symbols.layout());
    println!("task offsets {}", k.offsets.to_compact());
    for name in args {
        match k.symbols.by_name(&name) {
            Some(s) => println!("{:#018x} {} {}", s.address, s.kind, s.name),
            None => println!("{name}: not found"),
        }
    }
    Ok(())
}
