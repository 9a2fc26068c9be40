//! `tollgate check`: the configuration validated (by `main`, before any command runs) and
//! printed back, and the certificate checks that belong to validation.

use http::Uri;

use crate::config::{Config, HostPattern};

use super::output::{say, Out};

/// `FILE: server.certs[i]: problem` for every certificate that does not load.
pub fn certificate_errors(config: &Config) -> Vec<String> {
    config
        .server
        .certs
        .iter()
        .enumerate()
        .filter_map(|(i, cert)| {
            crate::tls::load_certified_key(cert)
                .err()
                .map(|err| format!("{}: server.certs[{i}]: {err}", config.source.display()))
        })
        .collect()
}

/// `tollgate check`: what the file configures, one line per listener, upstream, route and
/// limit, as the file spells it.
pub fn check(config: &Config, out: &mut Out<'_>) {
    say!(out, "{}: configuration OK", config.source.display());
    for addr in &config.server.listen {
        say!(out, "listen      {addr}");
    }
    for addr in &config.server.tls_listen {
        say!(out, "tls_listen  {addr}");
    }
    if let Some(proxy_protocol) = &config.server.proxy_protocol {
        let from: Vec<String> = proxy_protocol
            .from
            .iter()
            .map(ToString::to_string)
            .collect();
        say!(
            out,
            "proxy_protocol from {} (PROXY v1/v2 header required from these peers)",
            from.join(", ")
        );
    }
    if let Some(admin) = &config.admin {
        say!(out, "admin       {}", admin.listen);
    }
    match &config.store.url {
        Some(_) => say!(
            out,
            "store       postgres (on_error = {})",
            config.store.on_error.as_str()
        ),
        None => say!(
            out,
            "store       memory (counters not shared between instances)"
        ),
    }
    for upstream in &config.upstreams {
        let urls: Vec<String> = upstream.urls.iter().map(origin_text).collect();
        say!(out, "upstream    {} -> {}", upstream.name, urls.join(", "));
    }
    for route in &config.routes {
        let host = match &route.host {
            Some(HostPattern::Exact(h)) => h.clone(),
            Some(HostPattern::Suffix(s)) => format!("*{s}"),
            None => "*".to_string(),
        };
        let methods = route
            .methods
            .as_ref()
            .map(|m| m.iter().map(|m| m.as_str()).collect::<Vec<_>>().join(","))
            .unwrap_or_else(|| "any".to_string());
        say!(
            out,
            "route       {}: host {} path {} methods {} -> {}{}{}",
            route.name,
            host,
            route.path_prefix,
            methods,
            config.upstream(route).name,
            if route.shadow { " (shadow)" } else { "" },
            match route.on_store_error {
                Some(policy) => format!(" (on_store_error = {})", policy.as_str()),
                None => String::new(),
            }
        );
        for limit in &route.limits {
            say!(
                out,
                "  limit     {} {} per {}s {}{}{}{}",
                limit.policy_name(),
                limit.requests,
                limit.window_secs,
                limit.algorithm.as_str(),
                super::output::units_text(limit),
                if limit.reserve { " reserve" } else { "" },
                if limit.shadow { " (shadow)" } else { "" }
            );
        }
    }
}

/// An upstream origin as the file wrote it: `scheme://authority`. `Uri`'s own `Display`
/// adds the path `/` that an origin has none of, which reads as if tollgate changed the URL.
fn origin_text(origin: &Uri) -> String {
    match (origin.scheme_str(), origin.authority()) {
        (Some(scheme), Some(authority)) => format!("{scheme}://{authority}"),
        _ => origin.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"
[server]
listen = ["127.0.0.1:0"]

[upstreams.api]
urls = ["http://127.0.0.1:9000", "https://backend.internal:8443"]

[[routes]]
name = "login"
host = "*.example.com"
path_prefix = "/login"
methods = ["POST"]
upstream = "api"
on_store_error = "local"

  [[routes.limits]]
  key = "ip"
  requests = 5
  window = "1m"

  [[routes.limits]]
  key = "global"
  requests = 100
  window = "1h"
  algorithm = "sliding"
  shadow = true
"#;

    fn checked(text: &str) -> String {
        let config = crate::config::load_str(std::path::Path::new("t.toml"), text, &|_| None)
            .expect("a valid file");
        let mut buf = Vec::new();
        let mut out = Out::to(&mut buf);
        check(&config, &mut out);
        out.finish().expect("written");
        String::from_utf8(buf).expect("utf-8")
    }

    #[test]
    fn check_prints_every_listener_route_and_limit() {
        let text = checked(FILE);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "t.toml: configuration OK");
        assert!(lines.contains(&"listen      127.0.0.1:0"), "{text}");
        assert!(
            lines.contains(&"store       memory (counters not shared between instances)"),
            "{text}"
        );
        assert!(
            lines.contains(
                &"upstream    api -> http://127.0.0.1:9000, https://backend.internal:8443"
            ),
            "{text}"
        );
        assert!(
            lines.contains(
                &"route       login: host *.example.com path /login methods POST -> api (on_store_error = local)"
            ),
            "{text}"
        );
        assert!(
            lines.contains(&"  limit     login:ip 5 per 60s fixed"),
            "{text}"
        );
        assert!(
            lines.contains(&"  limit     login:global 100 per 3600s sliding (shadow)"),
            "{text}"
        );
    }

    #[test]
    fn an_origin_is_shown_without_a_path_it_never_had() {
        let uri: Uri = "http://127.0.0.1:9000".parse().expect("a URI");
        assert_eq!(origin_text(&uri), "http://127.0.0.1:9000");
    }
}
