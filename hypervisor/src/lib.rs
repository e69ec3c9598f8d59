//! The hypervisor's pure logic: everything that decides without touching hardware (VM
//! configuration from module arguments, the guest's initial memory layout, device models, exit
//! statistics). It builds for the bare-metal binary (`main.rs`) and for the host, where
//! `cargo test -p hvprof-hypervisor --lib` runs its unit and property tests.
#![cfg_attr(not(test), no_std)]

extern crate alloc;

pub mod devices;
pub mod escape;
pub mod exit_stats;
pub mod guest_image;
pub mod linux_boot;
pub mod profiler;
pub mod rate;
pub mod vm_config;
