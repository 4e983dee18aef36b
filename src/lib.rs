pub mod config;
pub mod digest;
pub mod dispatch;
pub mod inbound;
pub mod payment;
pub mod store;
