//! Every HTTP/1.1 byte tollgate reads or writes itself (hyper reads and writes the rest).
//!
//! - [`rules`]: the framing rules, each written once: the limits, how `Content-Length`,
//!   `Transfer-Encoding` and a chunk-size line are read, strictly (what a client sends) and
//!   leniently (what an upstream answers, as hyper's client reads it), side by side.
//! - [`head`]: where a head ends and where its parts lie.
//! - [`guard`]: the framing guard below hyper's server (request smuggling).
//! - [`server`]: tollgate's own HTTP/1.1 server for simple requests, before hyper's.
//! - [`client`]: tollgate's own HTTP/1.1 client for requests without a body.
//! - [`lines`]: a response's field lines, from the own client to the own server.
//!
//! Nothing here knows the proxy, the forwarder or the server's connections: the own server is
//! given a [`server::Service`] (the proxy and the connection's activity record, from
//! `server::connection`), the own client a pool to park its connections in (`client::Park`, `forward`), and the
//! request and response bodies are the caller's. Dependencies point one way:
//! `server -> proxy -> forward -> http1 -> headers`.

pub mod client;
pub mod guard;
pub mod head;
pub mod lines;
pub mod rules;
pub mod server;
