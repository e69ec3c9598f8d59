//! The serial console: a 16550 UART (COM1 by default) through the `uart_16550` crate, 115200 8N1,
//! with its 16-byte transmit FIFO on.
//!
//! Until sampling starts, just before the VMs do (and again after they stop), output is
//! synchronous: at boot there is nothing else to do, and a boot that hangs must still show how
//! far it got. From then on, output never waits for the line where it need not: text (and, with
//! `channel=serial`, the sample log's frames) goes into a 64 KiB queue, and the queue is moved
//! into the UART's FIFO whenever the FIFO is empty — at every `print`, and by [`pump`], which the run loop calls after
//! VM exits, the scheduler between slices and the idle loop. At 115,200 baud a byte takes 87 µs
//! of line time; a VM exit that printed used to wait for every byte of its line. Only a full queue
//! makes a writer wait (the hypervisor's own messages), and guest output never does: it is
//! offered with [`try_print_guest_line`], which refuses what the queue cannot take now.
//!
//! Guest bytes are escaped before they reach the line: every control byte (including NUL, which
//! delimits the sample log's binary frames, and the frame-type bytes 0x01-0x08 a frame needs)
//! and every byte that is not part of valid UTF-8 is shown as `\xNN`, so no guest can write a
//! frame, a terminal escape sequence or a line break into the log (docs/SECURITY.md).
//!
//! The fault paths (exceptions, panic) must print even when the interrupted code held the lock;
//! they use [`emergency_writer`], which takes the lock by force, writes a frame delimiter first
//! (so a frame it cut short is only a damaged frame for the decoder, never merged with text),
//! sends what was queued, then its own text, synchronously.

use core::fmt::{self, Write};
use core::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use spin::Mutex;
use uart_16550::backend::PioBackend;
use uart_16550::spec::registers::LSR;
use uart_16550::{BaudRate, Config, Uart16550};

/// Bytes the queue holds.
const QUEUE_BYTES: usize = 64 * 1024;

/// Guest lines are refused when they would leave less free room than this: the hypervisor's own
/// messages keep a share of the queue whatever the guests print.
const RESERVED_FOR_HYPERVISOR: usize = QUEUE_BYTES / 4;

struct Queue {
    bytes: [u8; QUEUE_BYTES],
    /// Index of the oldest byte.
    head: usize,
    len: usize,
}

impl Queue {
    fn free(&self) -> usize {
        QUEUE_BYTES - self.len
    }

    fn push(&mut self, b: u8) {
        debug_assert!(self.len < QUEUE_BYTES);
        self.bytes[(self.head + self.len) % QUEUE_BYTES] = b;
        self.len += 1;
    }

    /// The oldest contiguous run of queued bytes.
    fn front(&self) -> &[u8] {
        let end = (self.head + self.len).min(QUEUE_BYTES);
        &self.bytes[self.head..end]
    }

    fn pop(&mut self, n: usize) {
        self.head = (self.head + n) % QUEUE_BYTES;
        self.len -= n;
    }
}

struct Console {
    uart: Option<Uart16550<PioBackend>>,
    queue: Queue,
}

static CONSOLE: Mutex<Console> = Mutex::new(Console {
    uart: None,
    queue: Queue {
        bytes: [0; QUEUE_BYTES],
        head: 0,
        len: 0,
    },
});

/// Bytes queued (read without the lock, so that [`pump`] costs one load when there is nothing).
static QUEUED: AtomicUsize = AtomicUsize::new(0);

/// The TSC before which the UART cannot take more (it is still sending what it was given), and
/// the TSC ticks one byte takes on the line (0 until the TSC is calibrated: pump at every call).
static NEXT_PUMP: AtomicU64 = AtomicU64::new(0);
static TICKS_PER_BYTE: AtomicU64 = AtomicU64::new(0);

/// Whether a synchronous send may halt the pCPU while the UART sends (`halt_while_sending`).
static HALTING: AtomicBool = AtomicBool::new(false);

/// How a synchronous send halts the pCPU until a TSC value (`halt_while_sending`).
static HALT: spin::Once<fn(u64)> = spin::Once::new();

/// From now on a synchronous send halts this pCPU until the UART can take more, with `halt`
/// (the profiler's `CpuProfiler::halt_for_console`, which uses the LAPIC timer; given by
/// `main`, so that the console depends on no other module), instead of spinning on the line
/// status: at 115,200 baud a byte is 87 µs, some 87,000 instructions of spinning at a 1 GHz clock,
/// which an emulator counting instructions must run one by one (a HLT it skips).
pub fn halt_while_sending(halt: fn(u64)) {
    HALT.call_once(|| halt);
    HALTING.store(true, Ordering::Relaxed);
}

/// Waits a little for the UART: halted until the line should have room again (`NEXT_PUMP`),
/// where that is allowed and known; else one spin.
fn wait_for_line() {
    let next = NEXT_PUMP.load(Ordering::Relaxed);
    match HALT.get() {
        Some(halt)
            if HALTING.load(Ordering::Relaxed)
                && TICKS_PER_BYTE.load(Ordering::Relaxed) > 0
                && next > crate::tsc::rdtsc() =>
        {
            halt(next)
        }
        _ => core::hint::spin_loop(),
    }
}

/// Output is queued (`true`, while VMs run) or sent before `print` returns.
static QUEUEING: AtomicBool = AtomicBool::new(false);

/// Queue output from now on (the VMs start), or send it at once again (they stopped; what was
/// queued is sent first).
pub fn set_queueing(on: bool) {
    QUEUEING.store(on, Ordering::Relaxed);
    if !on {
        CONSOLE.lock().flush();
    }
}

/// Tells the console how fast the TSC runs, so that [`pump`] calls between bytes cost one load.
pub fn set_tsc_hz(hz: u64) {
    // 115,200 baud, 10 bits per byte (start, 8 data, stop).
    TICKS_PER_BYTE.store(hz / 11_520, Ordering::Relaxed);
}

/// Sets up the UART at `port`. Without a UART there (real hardware without COM1) output is
/// dropped: there is nowhere else to send it this early.
pub fn init(port: u16) {
    let mut console = CONSOLE.lock();
    console.flush();
    console.uart = open(port);
}

fn open(port: u16) -> Option<Uart16550<PioBackend>> {
    // SAFETY: the port range [port, port + 8) is a 16550's register block on the PC platform (or
    // nothing, which `init` detects through the scratch register); the console lock serialises
    // every access.
    let mut uart = unsafe { Uart16550::new_port(port) }.ok()?;
    let config = Config {
        baud_rate: BaudRate::Baud115200,
        ..Config::DEFAULT
    };
    uart.init(config).ok()?;
    Some(uart)
}

impl Console {
    /// Moves queued bytes into the UART while it takes them (at most a FIFO's worth: the FIFO
    /// takes bytes only when empty). Never waits.
    fn pump(&mut self) {
        let Some(uart) = self.uart.as_mut() else {
            self.queue.pop(self.queue.len);
            QUEUED.store(0, Ordering::Relaxed);
            return;
        };
        let n = uart.send_bytes(self.queue.front());
        self.queue.pop(n);
        QUEUED.store(self.queue.len, Ordering::Relaxed);
        if n > 0 {
            let line = n as u64 * TICKS_PER_BYTE.load(Ordering::Relaxed);
            NEXT_PUMP.store(crate::tsc::rdtsc().saturating_add(line), Ordering::Relaxed);
        }
    }

    /// After new output: moves what the UART takes now while VMs run ([`set_queueing`]), else
    /// sends everything.
    fn send_or_queue(&mut self) {
        if QUEUEING.load(Ordering::Relaxed) {
            self.pump();
        } else {
            self.flush();
        }
    }

    /// Sends everything queued, waiting for the line: halted for the line time of what the
    /// UART took, unless it says it can take more already (an emulated UART that sends at once,
    /// as QEMU's does, would otherwise cost the line time in real time).
    fn flush(&mut self) {
        while self.queue.len > 0 {
            self.pump();
            if self.queue.len > 0 && !self.can_send() {
                wait_for_line();
            }
        }
    }

    /// Whether the UART's transmit holding register is empty (LSR bit 5).
    fn can_send(&mut self) -> bool {
        self.uart
            .as_mut()
            .is_none_or(|u| u.lsr().contains(LSR::THR_EMPTY))
    }

    /// Queues one byte; when the queue is full, waits until the UART has taken some.
    fn put(&mut self, b: u8) {
        while self.queue.free() == 0 {
            self.pump();
            core::hint::spin_loop();
        }
        self.queue.push(b);
    }

    /// Queues text, with `\n` sent as `\r\n`.
    fn put_text(&mut self, bytes: &[u8]) {
        for &b in bytes {
            if b == b'\n' {
                self.put(b'\r');
            }
            self.put(b);
        }
    }

    /// Waits until the UART has sent every byte (LSR.TEMT).
    fn drain(&mut self) {
        self.flush();
        if let Some(uart) = self.uart.as_mut() {
            while !uart.lsr().contains(LSR::TRANSMITTER_EMPTY) {
                wait_for_line();
            }
        }
    }
}

impl Write for Console {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.put_text(s.as_bytes());
        Ok(())
    }
}

#[doc(hidden)]
pub fn _print(args: fmt::Arguments) {
    // Only the fault paths can interrupt a holder of this lock on the same CPU, and they use
    // `emergency_writer`; the timer and NMI handlers never print.
    let mut console = CONSOLE.lock();
    let _ = console.write_fmt(args);
    console.send_or_queue();
}

/// Whether bytes wait in the queue and the UART may have room for them by now (TSC `now`).
pub fn pump_due(now: u64) -> bool {
    QUEUED.load(Ordering::Relaxed) != 0 && now >= NEXT_PUMP.load(Ordering::Relaxed)
}

/// Moves what is queued on into the UART if it has room; never waits (another CPU holding the
/// console is left to do it).
pub fn pump() {
    if !pump_due(crate::tsc::rdtsc()) {
        return;
    }
    if let Some(mut console) = CONSOLE.try_lock() {
        console.pump();
    }
}

/// Queues bytes as they are (binary sample-log frames: no newline translation). Frames hold no
/// 0x00 inside and are delimited by it, so they share the line with text.
pub fn write_raw(bytes: &[u8]) {
    let mut console = CONSOLE.lock();
    for &b in bytes {
        console.put(b);
    }
    console.send_or_queue();
}

/// Why a guest line was not queued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueFull;

/// Queues `[name] line` with the guest's bytes escaped (`hvprof_hypervisor::escape`), unless the
/// queue lacks the room: a guest never waits for the console, and never takes the share of the
/// queue kept for the hypervisor's own messages.
pub fn try_print_guest_line(name: &str, line: &[u8]) -> Result<(), QueueFull> {
    let escaped_len = hvprof_hypervisor::escape::escaped_len(line);
    // "[" name "] " line "\r\n"
    try_queue(name.len() + 3 + escaped_len + 2, |console| {
        console.put(b'[');
        console.put_text(name.as_bytes());
        console.put_text(b"] ");
        hvprof_hypervisor::escape::escape(line, |b| console.put(b));
    })
}

/// Queues the hypervisor's `line` (and a line break) unless the queue lacks the room, under the
/// same terms as a guest's line (`vm_report!`: lines a guest can cause): never waits for the
/// console line, and never takes the share kept for the hypervisor's own messages.
pub fn try_print_line(line: &str) -> Result<(), QueueFull> {
    try_queue(line.len() + 2, |console| console.put_text(line.as_bytes()))
}

/// Queues a line that `write` puts (its `need` bytes with the line break), then the line break,
/// when the queue has that room beyond the hypervisor's reserved share; else nothing.
fn try_queue(need: usize, write: impl FnOnce(&mut Console)) -> Result<(), QueueFull> {
    let mut console = CONSOLE.lock();
    if console.queue.free() < need + RESERVED_FOR_HYPERVISOR {
        drop(console);
        pump();
        return Err(QueueFull);
    }
    write(&mut console);
    console.put_text(b"\n");
    console.pump();
    Ok(())
}

/// Sends what is queued and waits until the UART has sent every byte (LSR.TEMT): powering off
/// earlier loses the tail.
pub fn drain() {
    CONSOLE.lock().drain();
}

/// A writer for the fault paths that does not wait for the console lock.
pub fn emergency_writer() -> EmergencyWriter {
    EmergencyWriter
}

pub struct EmergencyWriter;

impl EmergencyWriter {
    fn console(&mut self) -> spin::MutexGuard<'static, Console> {
        // On the way down nothing waits for an interrupt: the line is polled.
        HALTING.store(false, Ordering::Relaxed);
        if let Some(guard) = CONSOLE.try_lock() {
            return guard;
        }
        // SAFETY: called only on the way down (exception, panic) when the interrupted holder of
        // the lock will never run again on this CPU; the holder may have been cutting a frame or
        // a line short: the delimiter below ends either cleanly, and a garbled line is the worst
        // outcome if another CPU prints at the same moment.
        unsafe { CONSOLE.force_unlock() };
        let mut guard = CONSOLE.lock();
        guard.put_text(b"\0\n");
        guard
    }
}

impl Write for EmergencyWriter {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let mut console = self.console();
        console.put_text(s.as_bytes());
        console.flush();
        Ok(())
    }
}

#[macro_export]
macro_rules! print {
    ($($arg:tt)*) => ($crate::console::_print(format_args!($($arg)*)));
}

#[macro_export]
macro_rules! println {
    () => ($crate::print!("\n"));
    ($($arg:tt)*) => ($crate::console::_print(format_args!("{}\n", format_args!($($arg)*))));
}
