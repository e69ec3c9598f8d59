//! The end-to-end scenario runner: builds a GRUB ISO around the hypervisor, boots it in Bochs or
//! QEMU, follows the serial log, and checks it.
//!
//! - [`iso`]: the ISO builder (`grub.cfg`, `grub-mkrescue`).
//! - [`emulator`]: Bochs, QEMU TCG (SeaBIOS and OVMF) and QEMU KVM with nested VMX.
//! - [`process`]: starting an emulator and ending it at the end marker, a timeout or Ctrl-C.
//! - [`log`]: [`SerialLog`], what checks read.
//! - [`runner`]: [`Scenario`] and the parallel runner.
//! - [`scenarios`]: the scenarios themselves, and the log text they expect; [`channel_scenarios`]:
//!   the export channels' self-test.
//! - [`tools`]: the host programs needed, and the Debian packages that bring them.

pub mod benches;
pub mod channel_scenarios;
pub mod emulator;
pub mod iso;
pub mod linux_scenarios;
pub mod live_scenarios;
pub mod log;
pub mod pmu_scenarios;
pub mod process;
pub mod profile;
pub mod profile_scenarios;
pub mod runner;
pub mod scenarios;
pub mod security_scenarios;
pub mod smp_scenarios;
pub mod stack_scenarios;
pub mod tools;
pub mod vm_scenarios;

pub use emulator::Emulator;
pub use log::SerialLog;
pub use runner::{RunnerConfig, Scenario, Summary, Verdict, run_scenarios};
