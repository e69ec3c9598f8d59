//! The profiler's host-tested parts: the sample path's core (`sample_path`: a sample measured and
//! put into the ring, with the TSC, the interrupt flag and MSRs behind its `Processor` trait), a
//! guest sample's record from the VMCS (`guest_sample`, behind `FastRead`), the per-pCPU sample
//! ring and its slots, the deadline clock's arithmetic (`deadline`), the cost tallies (`costs`),
//! kicks between pCPUs (`kicks`), which walk serves a guest's call chain (`guest_chain`), the
//! frame-pointer walk of call chains (`stack_walk`), the walks by unwind tables with their read
//! budgets (`table_walk`), the walks' caches (`walk_cache`), the running vCPU's memory as those
//! walks read it (`guest_stack`) and the walk of a Linux guest's memory that names its running
//! task (`guest_walk`). The real processor behind those traits, the hypervisor's own stack, the
//! timers and the export are the binary's (`bin/hvprof/profiler/`).

pub mod costs;
pub mod deadline;
pub mod guest_chain;
pub mod guest_maps;
pub mod guest_sample;
pub mod guest_stack;
pub mod guest_walk;
pub mod kicks;
pub mod ring;
pub mod sample_path;
pub mod slots;
pub mod stack_walk;
pub mod table_walk;
#[cfg(test)]
pub(crate) mod test_guest;
pub mod walk_cache;
