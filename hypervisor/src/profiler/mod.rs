//! The profiler's host-tested parts: the per-pCPU sample ring and its slots, the frame-pointer
//! walk of call chains (`stack_walk`) and the walk of a Linux guest's memory that names its running task. The
//! sample path, the sampling clocks and the export are the binary's (`bin/hvprof/profiler/`).

pub mod guest_maps;
pub mod guest_walk;
pub mod ring;
pub mod slots;
pub mod stack_walk;
pub mod walk_cache;
