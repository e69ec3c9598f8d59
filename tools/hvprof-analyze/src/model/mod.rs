//! The capture's model, where a sample is attributed: the capture decoded, every sample
//! classified and counted on every core, the stacks named, the samples read again in time order,
//! the common time axis, what the capture lost. Uses `naming`, never `views` or `live`.

pub mod calls;
pub mod capture;
pub mod chains;
pub mod classify;
pub mod cost;
pub mod first_pass;
pub mod first_pass_part;
pub mod integrity;
pub mod interner;
pub mod losses;
pub(crate) mod merge;
pub mod par;
pub mod profile;
pub mod progress;
pub mod replay;
pub mod samples;
pub mod stack_names;
pub(crate) mod stack_table;
pub mod timeline;
pub mod units;
pub mod whole_stack;
pub mod window;
