//! The part of `cargo xtask test`'s `xtask-profile` stage that runs a guest's own profiler on
//! its virtual PMU (`cargo xtask profile --vpmu cpu`): Debian's `perf` (package linux-perf, a
//! client nobody here wrote) in the Linux guest counts and samples `/bin/shor 35 2 1`, and its
//! figures are compared with callgrind's count of the same binary on the same input on the host
//! (`target/linux/callgrind-shor.out`, made with the image) and with hvprof's own profile of the
//! same run. In Bochs a tick is an instruction, so the virtual PMU's instructions are exact.

use std::path::Path;
use std::process::{Command, Output};

use anyhow::{Context, Result, bail};

use crate::linux::output;
use crate::profile::report_json;
use crate::profile_debian::{Shares, callgrind_shares, compare, report_shares};

/// The run's folder name under the stage's folder.
pub const OUT: &str = "run-vpmu";

/// The sampling period of `perf record`, instructions: about 2,600 samples of shor, a number
/// prime to the program's loop lengths so that the samples do not fall in step with them.
const PERIOD: u64 = 100_003;

/// A program that reads its own `instructions:u` counter with RDPMC through the page
/// `perf_event_open` maps (Linux sets CR4.PCE while a process with such a page runs, and only
/// then: before it maps one, its RDPMC is #GP, a SIGSEGV), across three rounds of known work.
const RDPMC_PROGRAM: &str = r#"#include <linux/perf_event.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

static sigjmp_buf env;
static void on_segv(int sig) { (void)sig; siglongjmp(env, 1); }

static uint64_t rdpmc(uint32_t c) {
    uint32_t lo, hi;
    __asm__ volatile("rdpmc" : "=a"(lo), "=d"(hi) : "c"(c));
    return (uint64_t)hi << 32 | lo;
}

/* 2n instructions: n rounds of dec and jnz. */
static void __attribute__((noinline)) work(uint64_t n) {
    __asm__ volatile("1: dec %0\n\tjnz 1b" : "+r"(n));
}

static uint64_t read_counter(volatile struct perf_event_mmap_page *pc) {
    uint32_t seq;
    uint64_t count;
    do {
        seq = pc->lock;
        __asm__ volatile("" ::: "memory");
        uint32_t idx = pc->index;
        count = pc->offset;
        if (pc->cap_user_rdpmc && idx) {
            int64_t pmc = (int64_t)rdpmc(idx - 1);
            pmc = (int64_t)((uint64_t)pmc << (64 - pc->pmc_width)) >> (64 - pc->pmc_width);
            count += pmc;
        }
        __asm__ volatile("" ::: "memory");
    } while (pc->lock != seq);
    return count;
}

int main(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_segv;
    sigaction(SIGSEGV, &sa, 0);
    if (sigsetjmp(env, 1) == 0) {
        rdpmc(0);
        printf("rdpmc: unmapped: read\n");
    } else {
        printf("rdpmc: unmapped: SIGSEGV\n");
    }
    struct perf_event_attr a;
    memset(&a, 0, sizeof a);
    a.type = PERF_TYPE_HARDWARE;
    a.size = sizeof a;
    a.config = PERF_COUNT_HW_INSTRUCTIONS;
    a.exclude_kernel = 1;
    a.exclude_hv = 1;
    int fd = syscall(SYS_perf_event_open, &a, 0, -1, -1, 0);
    if (fd < 0) {
        perror("rdpmc: perf_event_open");
        return 2;
    }
    volatile struct perf_event_mmap_page *pc =
        mmap(0, sysconf(_SC_PAGESIZE), PROT_READ, MAP_SHARED, fd, 0);
    if (pc == MAP_FAILED) {
        perror("rdpmc: mmap");
        return 2;
    }
    printf("rdpmc: cap_user_rdpmc=%u index=%u width=%u\n", (unsigned)pc->cap_user_rdpmc,
           pc->index, pc->pmc_width);
    uint64_t n = 1000000, before = read_counter(pc);
    for (int i = 0; i < 3; i++) {
        work(n);
        uint64_t now = read_counter(pc);
        printf("rdpmc: delta=%llu work=%llu\n", (unsigned long long)(now - before),
               (unsigned long long)(2 * n));
        before = now;
    }
    return 0;
}
"#;

/// Two `perf stat`s at once, one on each vCPU of the one pCPU (the first counts `cycles:u` too),
/// their CSV lines on stdout marked `two vCPUs a:` and `b:`; `perf record` and `perf report` of
/// the same program; then the RDPMC program.
fn script() -> String {
    let stat = "perf stat -x, -e instructions:u";
    format!(
        "set -e\n\
         {stat},cycles:u -o /tmp/a.csv -- /bin/shor 35 2 1 &\n\
         {stat} -o /tmp/b.csv -- /bin/shor 35 2 1 &\n\
         wait\n\
         sed 's/^/two vCPUs a: /' /tmp/a.csv\n\
         sed 's/^/two vCPUs b: /' /tmp/b.csv\n\
         perf record -q -e instructions:u -c {PERIOD} -o /tmp/shor.data -- /bin/shor 35 2 1\n\
         perf report -i /tmp/shor.data --stdio --sort sym\n\
         ./rdpmc\n"
    )
}

/// The `cargo xtask profile` command of the run, its output in `dir/OUT`, with the RDPMC
/// program compiled. In Bochs: elsewhere the emulated counters estimate instructions from ticks.
pub fn command(xtask: &Path, dir: &Path) -> Result<Command> {
    let prog = crate::profile::compile_c(dir, "rdpmc", RDPMC_PROGRAM, &[])?;
    let mut c = Command::new(xtask);
    c.arg("profile")
        .arg("--out")
        .arg(dir.join(OUT))
        .arg("--add")
        .arg(&prog)
        .args([
            "--emulator",
            "bochs",
            // Two vCPUs on one pCPU; shor on one thread, as callgrind ran it.
            "--vcpus",
            "2",
            "--cpus",
            "1",
            "--env",
            "OMP_NUM_THREADS=1",
            "--vpmu",
            "cpu",
            // perf's libraries (Python, Perl) make a 135 MB initramfs.
            "--memory",
            "768M",
            "--deb",
            "linux-perf",
            "--",
            "sh",
            "-c",
        ])
        .arg(script())
        .stdin(std::process::Stdio::null());
    Ok(c)
}

/// The RDPMC program's lines: #GP before its counter was mapped, a counter RDPMC may read,
/// and each round's delta the round's work to within 0.1 % (the reads' own instructions).
fn check_rdpmc(stdout: &str) -> Result<()> {
    if !stdout.contains("rdpmc: unmapped: SIGSEGV") {
        bail!("RDPMC without a mapped counter (CR4.PCE clear) did not fault: {stdout:?}");
    }
    let caps = stdout
        .lines()
        .find(|l| l.starts_with("rdpmc: cap_user_rdpmc="))
        .context("no rdpmc: cap_user_rdpmc= line")?;
    if !caps.contains("cap_user_rdpmc=1") || caps.contains("index=0 ") {
        bail!("the mapped counter is not readable by RDPMC: {caps:?}");
    }
    let rounds: Vec<(u64, u64)> = stdout
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("rdpmc: delta=")?;
            let (d, w) = rest.split_once(" work=")?;
            Some((d.parse().ok()?, w.parse().ok()?))
        })
        .collect();
    if rounds.len() != 3 {
        bail!("{} rounds read, want 3: {stdout:?}", rounds.len());
    }
    for (delta, work) in rounds {
        println!(
            "profile check: {OUT}: RDPMC from user mode: {delta} instructions over {work} of work"
        );
        if delta < work || (delta - work) * 1000 > work {
            bail!("RDPMC's delta {delta} for {work} instructions of work");
        }
    }
    Ok(())
}

/// The value of event `event` in `perf stat -x,` output (`value,unit,event,...`).
fn stat_value(text: &str, event: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut f = l.split(',');
        let value = f.next()?;
        let _unit = f.next()?;
        (f.next()? == event).then(|| value.parse().ok())?
    })
}

/// `perf report --stdio --sort sym` rows `  52.90%  [.] function`: each function's share.
fn perf_shares(text: &str) -> Shares {
    let mut shares = Shares::new();
    for line in text.lines() {
        let mut w = line.split_whitespace();
        let (Some(share), Some("[.]"), Some(func)) = (w.next(), w.next(), w.next()) else {
            continue;
        };
        if let Some(Ok(s)) = share.strip_suffix('%').map(str::parse::<f64>) {
            *shares.entry(func.to_owned()).or_default() += s;
        }
    }
    shares
}

/// callgrind's instruction count of shor on the host (the `totals:` line).
fn callgrind_total(file: &Path) -> Result<u64> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?;
    text.lines()
        .find_map(|l| l.strip_prefix("totals:"))
        .and_then(|t| t.trim().parse().ok())
        .with_context(|| format!("no totals: line in {}", file.display()))
}

/// Checks the finished run: status 0; each of the two `perf stat`s' `instructions:u` within 1 %
/// of callgrind's count, and the first's `cycles:u` one a tick of it (the process's own run:
/// not the other vCPU's, whose steal `cpu` mode does not count); each function of 5 % or more in
/// perf's report within 2 points of callgrind's share and of hvprof's own profile's.
pub fn check(dir: &Path, out: &Output) -> Vec<String> {
    match check_run(dir, out) {
        Ok(()) => Vec::new(),
        Err(e) => vec![format!("{OUT}: {e:#}")],
    }
}

fn check_run(dir: &Path, out: &Output) -> Result<()> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() != Some(0) || !stdout.contains("35 = 7 * 5") {
        bail!(
            "status {:?} (want 0), stdout {:?}; stderr: {}",
            out.status.code(),
            stdout.trim(),
            stderr
                .lines()
                .filter(|l| l.starts_with("xtask") || l.contains("perf"))
                .collect::<Vec<_>>()
                .join(" | ")
        );
    }
    let run = dir.join(OUT);
    let callgrind = crate::linux::linux_dir().join("callgrind-shor.out");
    let total = callgrind_total(&callgrind)?;
    // Two at once on two vCPUs of one pCPU: each counts its own process.
    for which in ["a", "b"] {
        let prefix = format!("two vCPUs {which}: ");
        let lines: String = stdout
            .lines()
            .filter_map(|l| l.strip_prefix(&prefix))
            .map(|l| format!("{l}\n"))
            .collect();
        let n = stat_value(&lines, "instructions:u")
            .with_context(|| format!("no instructions:u from perf stat {which}"))?;
        let off = 100.0 * (n as f64 - total as f64) / total as f64;
        println!(
            "profile check: {OUT}: perf stat in the guest, two at once on two vCPUs of one pCPU, {which}: instructions:u {n}; callgrind {total} ({off:+.4} %)"
        );
        if off.abs() > 1.0 {
            bail!("perf stat {which}: instructions:u {n} is {off:+.3} % from callgrind's {total}");
        }
        if which == "a" {
            let cycles = stat_value(&lines, "cycles:u").context("no cycles:u from perf stat a")?;
            println!("profile check: {OUT}: perf stat a: cycles:u {cycles}");
            if cycles > n || (n - cycles) * 1000 > n {
                bail!(
                    "perf stat a: cycles:u {cycles} against instructions:u {n}: one tick an instruction in Bochs, without the other vCPU's time"
                );
            }
        }
    }
    let text = output(
        Command::new("callgrind_annotate")
            .args(["--threshold=100", "--auto=no"])
            .arg(&callgrind),
        "callgrind_annotate comes with Debian's valgrind package.",
    )?;
    let theirs = callgrind_shares(&text);
    let perf = perf_shares(&stdout);
    let report = report_json(&run, 100_000)?;
    let (hvprof, samples) = report_shares(&report, "shor")?;
    let mut bad = Vec::new();
    println!(
        "profile check: {OUT}: perf record -e instructions:u -c {PERIOD} in the guest, against callgrind and hvprof ({samples} samples), functions of 5 % or more:"
    );
    for (name, p, c) in compare(&perf, &theirs, 5.0) {
        let h = hvprof.get(&name).copied().unwrap_or(0.0);
        println!("profile check:   {p:6.2} % perf  {c:6.2} % callgrind  {h:6.2} % hvprof  {name}");
        if (p - c).abs() > 2.0 || (p - h).abs() > 2.0 {
            bad.push(format!(
                "{name}: {p:.2} % (callgrind {c:.2} %, hvprof {h:.2} %)"
            ));
        }
    }
    if perf.is_empty() {
        bail!("no function in perf report's output");
    }
    check_rdpmc(&stdout)?;
    if !bad.is_empty() {
        bail!("perf's report more than 2 points away: {}", bad.join(", "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perf_outputs_parse() {
        let stat = "259173527,,instructions:u,2482874015,100.00,,\n\
                    259173468,,cycles:u,2482874015,100.00,,\n";
        assert_eq!(stat_value(stat, "instructions:u"), Some(259_173_527));
        assert_eq!(stat_value(stat, "cycles:u"), Some(259_173_468));
        assert_eq!(stat_value(stat, "ref-cycles"), None);
        let report = "# Overhead  Symbol\n\
                      #\n\
                      \x20   52.90%  [.] quantum_toffoli._omp_fn.0\n\
                      \x20   11.97%  [.] quantum_sigma_x._omp_fn.0\n\
                      \x20    0.39%  [k] do_syscall_64\n";
        let s = perf_shares(report);
        assert_eq!(s.len(), 2, "user-mode rows only");
        assert_eq!(s["quantum_toffoli._omp_fn.0"], 52.90);
    }
}
