//! The unwind table of a real program, on a real stack: a C program built as the guests'
//! workloads are (gcc -O2 -static -no-pie: no frame pointers), whose innermost function copies
//! its own stack and registers to a file; the walk over that copy, by the table made from the
//! program's `.eh_frame`, must give the program's callers up to `_start`, and a frame-pointer
//! walk must not (so the table is what finds them). Skipped, with a message, without gcc.

use std::path::Path;
use std::process::Command;

use hvprof_linux_walk::cfi::{UnwindTable, UserEnd, UserStart, unwind_user};
use hvprof_linux_walk::model::Memory;
use hvprof_linux_walk::{Budget, GuestMemory};
use object::{Object, ObjectSection, ObjectSymbol};

const PROGRAM: &str = r#"
#include <stdio.h>
#include <string.h>
#include <stdlib.h>

static unsigned long regs[3];
static unsigned char copy[1 << 20];

/* Copies [sp, top of the stack) and the registers to `path`. */
__attribute__((noinline)) static void dump(const char *path, unsigned long sp)
{
    unsigned long top = 0, lo, hi;
    char line[512];
    FILE *maps = fopen("/proc/self/maps", "r");
    while (maps && fgets(line, sizeof line, maps))
        if (strstr(line, "[stack]") && sscanf(line, "%lx-%lx", &lo, &hi) == 2)
            top = hi;
    if (maps)
        fclose(maps);
    unsigned long len = top - sp;
    if (!top || len > sizeof copy)
        exit(2);
    memcpy(copy, (void *)sp, len);
    FILE *out = fopen(path, "wb");
    fwrite(regs, sizeof regs, 1, out);
    fwrite(&len, sizeof len, 1, out);
    fwrite(copy, 1, len, out);
    fclose(out);
}

volatile int sink;

__attribute__((noinline)) static int leaf(const char *path, int n)
{
    unsigned long sp, bp, ip;
    volatile int spill[8];
    for (int i = 0; i < 8; i++)
        spill[i] = n + i;
    __asm__ volatile("lea (%%rip), %0\n\tmov %%rsp, %1\n\tmov %%rbp, %2"
                     : "=r"(ip), "=r"(sp), "=r"(bp));
    regs[0] = ip;
    regs[1] = sp;
    regs[2] = bp;
    dump(path, sp);
    return spill[3] * 3;
}

__attribute__((noinline)) static int mid_b(const char *path, int n)
{
    int r = leaf(path, n + 1);
    sink = r;
    return r + 1;
}

__attribute__((noinline)) static int mid_a(const char *path, int n)
{
    char buf[100];
    snprintf(buf, sizeof buf, "%d", n);
    int r = mid_b(path, n * 2 + (int)strlen(buf));
    sink = r;
    return r ^ n;
}

int main(int argc, char **argv)
{
    return mid_a(argv[1], argc) == 12345;
}
"#;

fn gcc(dir: &Path) -> Option<std::path::PathBuf> {
    gcc_with(dir, &["-static", "-no-pie"])
}

fn gcc_with(dir: &Path, link: &[&str]) -> Option<std::path::PathBuf> {
    let src = dir.join("capture.c");
    let exe = dir.join(format!("capture{}", link.concat()));
    std::fs::write(&src, PROGRAM).unwrap();
    let out = Command::new("gcc")
        .args(link)
        .args(["-O2", "-fomit-frame-pointer", "-o"])
        .arg(&exe)
        .arg(&src)
        .output();
    match out {
        Ok(o) if o.status.success() => Some(exe),
        Ok(o) => panic!("gcc failed: {}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => {
            eprintln!("skipped: no gcc ({e})");
            None
        }
    }
}

/// The function each address falls in (without GCC's clone suffixes: `leaf.constprop.0` is
/// `leaf`).
fn namer(elf: &[u8]) -> impl Fn(u64) -> String + '_ {
    let file = object::File::parse(elf).unwrap();
    let mut syms: Vec<(u64, u64, String)> = file
        .symbols()
        .filter(|s| s.kind() == object::SymbolKind::Text && s.size() > 0)
        .map(|s| (s.address(), s.size(), s.name().unwrap_or("?").to_owned()))
        .collect();
    syms.sort();
    move |a: u64| {
        syms.iter()
            .rev()
            .find(|(at, size, _)| *at <= a && a < at + size)
            .map_or_else(
                || format!("{a:#x}"),
                |s| s.2.split('.').next().unwrap_or("").to_owned(),
            )
    }
}

fn walk(mem: &Memory, tables: &[UnwindTable<'_>], start: UserStart) -> (Vec<u64>, UserEnd) {
    let mut chain = Vec::new();
    let mut budget = Budget::new(200);
    let end = unwind_user(mem, tables, &(), start, &mut budget, &mut |ip| {
        chain.push(ip);
        chain.len() < 32
    });
    (chain, end)
}

#[test]
fn a_real_stack_unwinds_to_start_by_the_table() {
    let dir = std::env::temp_dir().join(format!("hvprof-unwind-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let Some(exe) = gcc(&dir) else { return };
    let dump = dir.join("stack.bin");
    let status = Command::new(&exe).arg(&dump).status().unwrap();
    assert!(status.code().is_some(), "the capture program crashed");
    let elf = std::fs::read(&exe).unwrap();
    let (table_bytes, summary) = linux_guest::unwind::unwind_table(&elf).unwrap();
    let table = UnwindTable::parse(&table_bytes).unwrap();
    assert!(summary.entries > 1000 && summary.fdes > 100, "{summary:?}");

    // The process's memory: its stack copy, and its loaded segments (the build id among them).
    let bytes = std::fs::read(&dump).unwrap();
    let word = |i: usize| u64::from_le_bytes(bytes[8 * i..8 * i + 8].try_into().unwrap());
    let (ip, sp, bp, len) = (word(0), word(1), word(2), word(3) as usize);
    let mut mem = Memory::default();
    mem.put(sp, &bytes[32..32 + len]);
    let file = object::File::parse(&*elf).unwrap();
    for s in file.sections() {
        if s.address() != 0 && s.name().is_ok_and(|n| n.starts_with(".note")) {
            mem.put(s.address(), s.data().unwrap());
        }
    }
    let mut id = [0u8; 20];
    assert!(mem.read(table.id_addr, &mut id[..table.id().len()]));

    let name = namer(&elf);
    let start = UserStart { ip, sp, bp };
    assert_eq!(name(ip), "leaf");
    let (chain, end) = walk(&mem, &[table], start);
    let names: Vec<String> = chain.iter().map(|&a| name(a)).collect();
    assert_eq!(end, UserEnd::Complete, "{names:?}");
    assert_eq!(names[..3], ["mid_b", "mid_a", "main"], "{names:?}");
    assert_eq!(
        names.last().map(String::as_str),
        Some("_start"),
        "{names:?}"
    );

    // Without the table (or with another program's), the frame pointer alone cannot.
    let (fp_chain, _) = walk(&mem, &[], start);
    let fp_names: Vec<String> = fp_chain.iter().map(|&a| name(a)).collect();
    assert_ne!(fp_names.get(..3), names.get(..3), "{fp_names:?}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_pie_is_refused_with_the_reason() {
    let dir = std::env::temp_dir().join(format!("hvprof-unwind-pie-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let Some(exe) = gcc_with(&dir, &["-pie", "-fPIE"]) else {
        return;
    };
    let err = linux_guest::unwind::unwind_table(&std::fs::read(&exe).unwrap()).unwrap_err();
    assert!(err.to_string().contains("non-PIE"), "{err}");
    let err = linux_guest::unwind::unwind_table(b"not an ELF").unwrap_err();
    assert!(err.to_string().contains("not an ELF"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}
