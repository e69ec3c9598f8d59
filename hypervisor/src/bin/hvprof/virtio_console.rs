//! A virtio console as an output channel for the sample log (`channel=virtio`): the modern
//! (virtio 1.x) PCI transport, one split virtqueue (port 0's transmitq), polled. When hvprof
//! runs as a guest of QEMU or QEMU/KVM with `-device virtio-serial-pci -device
//! virtconsole,chardev=...`, whole buffers go out per notification instead of a byte per port
//! write; the UART keeps the console text.
//!
//! References: Virtual I/O Device (VIRTIO) Version 1.1: §3.1.1 (driver initialisation), §4.1.4
//! (PCI capabilities: common, notify), §2.6 (split virtqueues), §5.3 (console device: without
//! VIRTIO_CONSOLE_F_MULTIPORT, queue 0 is port 0's receiveq and queue 1 its transmitq).

use crate::{memory, pci};
use core::sync::atomic::{Ordering, fence};
use spin::Mutex;

/// virtio's PCI vendor, and the modern console's device ID (0x1040 + device type 3).
const VENDOR: u16 = 0x1af4;
const CONSOLE_MODERN: u16 = 0x1043;
/// The transitional console's device ID: it has the modern capabilities too (`disable-legacy`
/// off, QEMU's default).
const CONSOLE_TRANSITIONAL: u16 = 0x1003;

/// Vendor-specific capability types (§4.1.4).
const CAP_VENDOR: u8 = 0x09;
const CFG_COMMON: u8 = 1;
const CFG_NOTIFY: u8 = 2;

/// Common configuration registers (§4.1.4.3).
const DEVICE_FEATURE_SELECT: usize = 0x00;
const DEVICE_FEATURE: usize = 0x04;
const DRIVER_FEATURE_SELECT: usize = 0x08;
const DRIVER_FEATURE: usize = 0x0c;
const DEVICE_STATUS: usize = 0x14;
const QUEUE_SELECT: usize = 0x16;
const QUEUE_SIZE: usize = 0x18;
const QUEUE_ENABLE: usize = 0x1c;
const QUEUE_NOTIFY_OFF: usize = 0x1e;
const QUEUE_DESC: usize = 0x20;
const QUEUE_DRIVER: usize = 0x28;
const QUEUE_DEVICE: usize = 0x30;

/// Device status bits (§2.1).
const ACKNOWLEDGE: u8 = 1;
const DRIVER: u8 = 2;
const DRIVER_OK: u8 = 4;
const FEATURES_OK: u8 = 8;
const FAILED: u8 = 128;

/// VIRTIO_F_VERSION_1 (feature bit 32, §6): the only feature negotiated.
const F_VERSION_1_HIGH: u32 = 1 << 0;

/// Port 0's transmitq.
const TRANSMITQ: u16 = 1;
/// Descriptors (and buffers) used: at most the queue's size.
const MAX_QUEUE: u16 = 64;
/// Bytes per buffer.
const BUFFER: usize = 16 * 1024;

/// How long to wait for the device to give a buffer back (polls of the used ring) before the
/// channel is given up as stuck.
const USED_POLLS: u32 = 50_000_000;

/// A split virtqueue's descriptor (§2.6.5).
#[repr(C)]
struct Descriptor {
    addr: u64,
    len: u32,
    flags: u16,
    next: u16,
}

struct Console {
    common: u64,
    notify: u64,
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    /// One buffer per descriptor, `BUFFER` bytes each.
    buffers: u64,
    /// Buffers made available so far (the avail ring's index), and seen used.
    next: u16,
    done: u16,
    /// Bytes in the buffer being filled (the one of descriptor `next % size`).
    fill: usize,
    sent: u64,
    /// Bytes refused because the device stopped giving buffers back.
    lost: u64,
    stuck: bool,
}

static CONSOLE: Mutex<Option<Console>> = Mutex::new(None);

/// Reads a device register.
///
/// # Safety
/// `addr` is a mapped register of the device, `T` its width.
unsafe fn reg_read<T: Copy>(addr: u64) -> T {
    // SAFETY: the caller's contract.
    unsafe { (addr as *const T).read_volatile() }
}

/// Writes a device register.
///
/// # Safety
/// As [`reg_read`].
unsafe fn reg_write<T: Copy>(addr: u64, value: T) {
    // SAFETY: the caller's contract.
    unsafe { (addr as *mut T).write_volatile(value) }
}

/// What `init` found.
pub enum Found {
    /// The console at this PCI function, its transmitq of this size, its common configuration
    /// at this physical address.
    Ready {
        function: pci::Function,
        queue: u16,
        common: u64,
    },
    /// No virtio console on the PCI bus.
    Absent,
    /// One is there but could not be set up.
    Failed(&'static str),
}

impl Found {
    /// What was found, in words (after `channel=virtio: `).
    pub fn describe(&self) -> alloc::string::String {
        match self {
            Found::Ready {
                function,
                queue,
                common,
            } => alloc::format!(
                "virtio console at PCI {:02x}:{:02x}.{} (registers at {common:#x}), transmitq of {queue}",
                function.bus,
                function.device,
                function.function
            ),
            Found::Absent => "no virtio console on the PCI bus".into(),
            Found::Failed(e) => alloc::format!("the virtio console could not be set up ({e})"),
        }
    }
}

/// Finds the virtio console and sets up its transmitq.
pub fn init() -> Found {
    let Some(function) =
        pci::find(VENDOR, CONSOLE_MODERN).or_else(|| pci::find(VENDOR, CONSOLE_TRANSITIONAL))
    else {
        return Found::Absent;
    };
    match setup(function) {
        Ok(console) => {
            let (queue, common) = (console.size, console.common);
            *CONSOLE.lock() = Some(console);
            Found::Ready {
                function,
                queue,
                common,
            }
        }
        Err(e) => Found::Failed(e),
    }
}

/// The address of the structure a vendor capability of `cfg_type` describes, and (notify)
/// the multiplier that follows it.
fn capability(function: pci::Function, cfg_type: u8) -> Result<(u64, u32), &'static str> {
    for at in function.capabilities() {
        if function.read8(at) != CAP_VENDOR || function.read8(at + 3) != cfg_type {
            continue;
        }
        let bar = function.read8(at + 4);
        let offset = u64::from(function.read32(at + 8));
        let length = u64::from(function.read32(at + 12));
        let base = function
            .memory_bar(bar)
            .ok_or("a virtio capability names a BAR that is not a memory BAR")?;
        memory::map_device(base + offset, length.max(1))?;
        let multiplier = if cfg_type == CFG_NOTIFY {
            function.read32(at + 16)
        } else {
            0
        };
        return Ok((base + offset, multiplier));
    }
    Err("no virtio 1.x capability (a legacy-only device)")
}

fn setup(function: pci::Function) -> Result<Console, &'static str> {
    function.enable(pci::COMMAND_MEMORY | pci::COMMAND_BUS_MASTER);
    let (common, _) = capability(function, CFG_COMMON)?;
    let (notify_base, multiplier) = capability(function, CFG_NOTIFY)?;
    // SAFETY: for every register access below, `common` is the device's common configuration
    // structure, just mapped (uncachable) by `capability`, accessed with each register's width
    // (§4.1.4.3); the device belongs to the hypervisor (guests see no PCI device).
    unsafe {
        // §3.1.1: reset, acknowledge, driver.
        reg_write::<u8>(common + DEVICE_STATUS as u64, 0);
        while reg_read::<u8>(common + DEVICE_STATUS as u64) != 0 {
            core::hint::spin_loop();
        }
        reg_write::<u8>(common + DEVICE_STATUS as u64, ACKNOWLEDGE);
        reg_write::<u8>(common + DEVICE_STATUS as u64, ACKNOWLEDGE | DRIVER);
        // Features: VERSION_1 only.
        reg_write::<u32>(common + DEVICE_FEATURE_SELECT as u64, 1);
        if reg_read::<u32>(common + DEVICE_FEATURE as u64) & F_VERSION_1_HIGH == 0 {
            reg_write::<u8>(common + DEVICE_STATUS as u64, FAILED);
            return Err("the device does not offer VIRTIO_F_VERSION_1");
        }
        reg_write::<u32>(common + DRIVER_FEATURE_SELECT as u64, 0);
        reg_write::<u32>(common + DRIVER_FEATURE as u64, 0);
        reg_write::<u32>(common + DRIVER_FEATURE_SELECT as u64, 1);
        reg_write::<u32>(common + DRIVER_FEATURE as u64, F_VERSION_1_HIGH);
        reg_write::<u8>(
            common + DEVICE_STATUS as u64,
            ACKNOWLEDGE | DRIVER | FEATURES_OK,
        );
        if reg_read::<u8>(common + DEVICE_STATUS as u64) & FEATURES_OK == 0 {
            reg_write::<u8>(common + DEVICE_STATUS as u64, FAILED);
            return Err("the device refused the features");
        }
        // The transmitq (§4.1.5.1.3).
        reg_write::<u16>(common + QUEUE_SELECT as u64, TRANSMITQ);
        let max = reg_read::<u16>(common + QUEUE_SIZE as u64);
        if max == 0 {
            reg_write::<u8>(common + DEVICE_STATUS as u64, FAILED);
            return Err("port 0's transmitq does not exist");
        }
        // A power of two, at most the device's maximum and MAX_QUEUE.
        let mut size = MAX_QUEUE;
        while size > max {
            size /= 2;
        }
        reg_write::<u16>(common + QUEUE_SIZE as u64, size);
        let n = u64::from(size);
        // Descriptor table (16-byte aligned), driver area (2), device area (4): one page each
        // is enough for 64 entries (§2.6); zeroed.
        let desc = memory::alloc_zeroed(16 * n, 4096).ok_or("no memory for the virtqueue")?;
        let avail = memory::alloc_zeroed(6 + 2 * n, 4096).ok_or("no memory for the virtqueue")?;
        let used = memory::alloc_zeroed(6 + 8 * n, 4096).ok_or("no memory for the virtqueue")?;
        let buffers =
            memory::alloc_zeroed(BUFFER as u64 * n, 4096).ok_or("no memory for the buffers")?;
        for i in 0..n {
            (desc as *mut Descriptor)
                .add(i as usize)
                .write_volatile(Descriptor {
                    addr: buffers + i * BUFFER as u64,
                    len: 0,
                    flags: 0,
                    next: 0,
                });
        }
        reg_write::<u64>(common + QUEUE_DESC as u64, desc);
        reg_write::<u64>(common + QUEUE_DRIVER as u64, avail);
        reg_write::<u64>(common + QUEUE_DEVICE as u64, used);
        let notify_off = reg_read::<u16>(common + QUEUE_NOTIFY_OFF as u64);
        reg_write::<u16>(common + QUEUE_ENABLE as u64, 1);
        reg_write::<u8>(
            common + DEVICE_STATUS as u64,
            ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK,
        );
        Ok(Console {
            common,
            notify: notify_base + u64::from(notify_off) * u64::from(multiplier),
            size,
            desc,
            avail,
            used,
            buffers,
            next: 0,
            done: 0,
            fill: 0,
            sent: 0,
            lost: 0,
            stuck: false,
        })
    }
}

impl Console {
    fn slot(&self) -> u64 {
        u64::from(self.next % self.size)
    }

    /// Waits until the buffer about to be filled is free (the device has used it).
    fn wait_free(&mut self) -> bool {
        let mut polls = 0;
        while self.next.wrapping_sub(self.done) >= self.size {
            // SAFETY: `used` is the device area this driver allocated (identity-mapped); its
            // index (offset 2) is written by the device (§2.6.8).
            let used = unsafe { reg_read::<u16>(self.used + 2) };
            fence(Ordering::Acquire);
            self.done = used;
            polls += 1;
            if polls > USED_POLLS {
                self.stuck = true;
                return false;
            }
            core::hint::spin_loop();
        }
        true
    }

    /// Makes the buffer being filled available to the device and notifies it.
    fn submit(&mut self) {
        if self.fill == 0 {
            return;
        }
        let slot = self.slot();
        // SAFETY: the descriptor, the driver area and the notify register are this driver's
        // (§2.6.5, §2.6.6, §4.1.4.4); the descriptor's buffer is not in the device's hands (it
        // was free when filling began, `wait_free`). The barriers order the descriptor before the
        // ring entry, the entry before the index, the index before the notification (§2.6.13).
        unsafe {
            let d = (self.desc as *mut Descriptor).add(slot as usize);
            (&raw mut (*d).len).write_volatile(self.fill as u32);
            let ring = self.avail + 4 + 2 * u64::from(self.next % self.size);
            reg_write::<u16>(ring, slot as u16);
            fence(Ordering::Release);
            self.next = self.next.wrapping_add(1);
            reg_write::<u16>(self.avail + 2, self.next);
            fence(Ordering::SeqCst);
            reg_write::<u16>(self.notify, TRANSMITQ);
        }
        self.sent += self.fill as u64;
        self.fill = 0;
    }

    fn write(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.stuck || (self.fill == 0 && !self.wait_free()) {
                self.lost += bytes.len() as u64;
                return;
            }
            let take = bytes.len().min(BUFFER - self.fill);
            let at = self.buffers + self.slot() * BUFFER as u64 + self.fill as u64;
            // SAFETY: the buffer of the current slot is free (not in the device's hands) and
            // `take` bytes fit in it from `fill` on.
            unsafe {
                core::ptr::copy_nonoverlapping(bytes.as_ptr(), at as *mut u8, take);
            }
            self.fill += take;
            bytes = &bytes[take..];
            if self.fill == BUFFER {
                self.submit();
            }
        }
    }
}

/// Queues `bytes` (sent when a buffer fills, or at [`flush`]). Bytes are dropped (and counted)
/// if the device stops giving buffers back.
pub fn write(bytes: &[u8]) {
    if let Some(c) = CONSOLE.lock().as_mut() {
        c.write(bytes);
    }
}

/// Sends what is queued.
pub fn flush() {
    if let Some(c) = CONSOLE.lock().as_mut() {
        c.submit();
    }
}

/// Sends what is queued and waits until the device has taken every buffer.
pub fn drain() {
    if let Some(c) = CONSOLE.lock().as_mut() {
        c.submit();
        let mut polls = 0;
        while c.done != c.next && polls < USED_POLLS {
            // SAFETY: as in `wait_free`.
            c.done = unsafe { reg_read::<u16>(c.used + 2) };
            polls += 1;
            core::hint::spin_loop();
        }
    }
}

/// Bytes handed to the device, and bytes lost.
pub fn counts() -> (u64, u64) {
    CONSOLE.lock().as_ref().map_or((0, 0), |c| (c.sent, c.lost))
}

/// Whether the device's common configuration says it failed or needs a reset.
pub fn healthy() -> bool {
    CONSOLE.lock().as_ref().is_some_and(|c| {
        // SAFETY: as in `setup`.
        let status = unsafe { reg_read::<u8>(c.common + DEVICE_STATUS as u64) };
        status & (FAILED | 64) == 0
    })
}
