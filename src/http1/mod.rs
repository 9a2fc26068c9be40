//! Every HTTP/1.1 byte tollgate reads or writes itself.
//!
//! - [`rules`]: the framing rules (lengths, codings, chunk sizes, limits), each once.
//! - [`head`]: where a head ends and where its parts lie.
//! - [`lines`]: a response's field lines, from tollgate's own client to its own server.
//! - [`guard`]: the framing guard below hyper's server (request smuggling).
//! - [`server`]: tollgate's own HTTP/1.1 server for simple requests, before hyper's.
//! - [`client`]: tollgate's own HTTP/1.1 client for requests without a body.

pub mod client;
pub mod guard;
pub mod head;
pub mod lines;
pub mod rules;
pub mod server;
