//! The GPU fleet: inventories and replica placement ([`inventory`]), and engine launch
//! commands for vLLM and SGLang ([`launch`]). SSH provisioning builds on these.

pub mod inventory;
pub mod launch;
pub mod provision;
pub mod ssh;
