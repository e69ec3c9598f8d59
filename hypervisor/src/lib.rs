//! The hypervisor's pure logic: everything that decides without touching hardware (VM
//! configuration from module arguments, the guest's initial memory layout, the Linux boot protocol,
//! device models, the profiler's ring and guest task walk). It builds for the bare-metal binary
//! (`bin/hvprof/main.rs`, which holds everything that touches hardware) and for the host, where
//! `cargo test -p hvprof-hypervisor --lib` runs its unit and property tests.
#![cfg_attr(not(test), no_std)]

extern crate alloc;

pub mod cpuid_policy;
pub mod devices;
pub mod escape;
pub mod guest_acpi;
pub mod guest_image;
pub mod guest_ram;
pub mod guest_tsc;
pub mod linux_boot;
pub mod mmio_decode;
pub mod multiboot;
pub mod output_store;
pub mod profiler;
pub mod rate;
pub mod spin_sites;
pub mod string_io;
pub mod vcpu_pmu;
pub mod vm_config;
pub mod vmcs_setup;
