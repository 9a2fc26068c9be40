//! TLS to PostgreSQL (contract §6): the `sslmode` and trust-root settings of `store.url`,
//! and a rustls connector for tokio-postgres.
//!
//! tokio-postgres negotiates TLS itself (the SSLRequest, falling back to plaintext under
//! `prefer` when the server declines) but knows only `disable`, `prefer` and `require`, and
//! brings no TLS implementation. This module:
//!
//! - **Reads the TLS options out of the URL** ([`parse`]), in both the `postgres://` and the
//!   key=value form, before the rest goes to tokio-postgres: `sslmode` (`disable`, `prefer`,
//!   the default, `require`, `verify-ca`, `verify-full`) and `sslrootcert` (a PEM file, or
//!   `system` for the bundled roots). The libpq options tollgate does not implement (client
//!   certificates, CRLs, ...) are refused by name instead of with tokio-postgres' generic
//!   message. The trust root is `sslrootcert`, else `store.ca_file`, else Mozilla's roots
//!   (webpki-roots).
//! - **Checks what can be checked before connecting**: a trust root only with a mode that
//!   verifies (a CA file with `require` would look like verification and be none);
//!   `verify-full` needs a host name to check the certificate against (not a Unix socket, not
//!   `hostaddr` alone); TLS modes that insist on encryption cannot use a Unix socket, where
//!   PostgreSQL never offers TLS. `tollgate check` runs the same code.
//! - **Connects** ([`MakeRustls`]) with the *ring* provider, TLS 1.2 and 1.3, ALPN
//!   `postgresql` (PostgreSQL 17 refuses any other ALPN value). Verification per mode, as
//!   libpq does it: `require` encrypts and verifies nothing (not even the chain: it protects
//!   against a passive eavesdropper only), `verify-ca` checks the chain to the trust root
//!   but not the name, `verify-full` both.
//! - **Explains TLS failures** ([`tls_problem`]) in the words of what to change, for the
//!   store's failure log (cause `tls`).
//!
//! With a password, SCRAM uses channel binding (`tls-server-end-point`, RFC 5929) when the
//! server's certificate says which hash to use, so a man in the middle cannot relay the
//! authentication even under `require`; otherwise plain SCRAM, as libpq does.

use std::fmt;
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};
use tokio_postgres::Socket;

use crate::error::Detail;

/// The `sslmode` of `store.url`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    /// TLS when the server offers it, plaintext otherwise; no verification.
    Prefer,
    /// TLS or no connection; no verification of the certificate.
    Require,
    /// TLS, the certificate chained to the trust root; any host name.
    VerifyCa,
    /// TLS, the certificate chained to the trust root and valid for the host name.
    VerifyFull,
}

impl SslMode {
    fn verifies(self) -> bool {
        matches!(self, SslMode::VerifyCa | SslMode::VerifyFull)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

/// Where the certificates to trust come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TrustRoot {
    /// Mozilla's roots, bundled (webpki-roots): public CAs only.
    Bundled,
    /// Every certificate of a PEM file (`sslrootcert`, or `store.ca_file`).
    File {
        path: PathBuf,
        /// The setting it came from, for messages.
        origin: &'static str,
    },
}

/// How to speak TLS to the database, read from `store.url` and `store.ca_file`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    pub mode: SslMode,
    pub root: TrustRoot,
}

/// libpq options tollgate does not implement: refused by name, so a URL copied from a
/// provider's documentation fails `check` with a message that says which option and why.
const UNSUPPORTED: &[(&str, &str)] = &[
    ("sslcert", "client certificates are not supported"),
    ("sslkey", "client certificates are not supported"),
    ("sslpassword", "client certificates are not supported"),
    ("sslcertmode", "client certificates are not supported"),
    ("sslcrl", "certificate revocation lists are not supported"),
    (
        "sslcrldir",
        "certificate revocation lists are not supported",
    ),
    ("sslsni", "SNI is always sent for host names"),
    ("sslcompression", "TLS compression is not supported"),
    (
        "ssl_min_protocol_version",
        "tollgate always uses TLS 1.2 or 1.3",
    ),
    (
        "ssl_max_protocol_version",
        "tollgate always uses TLS 1.2 or 1.3",
    ),
    ("requiressl", "use sslmode=require"),
];

/// Splits `url` into tokio-postgres' configuration and tollgate's TLS settings, and checks
/// them together (see the module docs). `ca_file` is `store.ca_file`, already resolved.
///
/// Messages never contain the URL or any part of it but option names and fixed words: it
/// may carry a password.
pub fn parse(
    url: &str,
    ca_file: Option<&Path>,
) -> Result<(tokio_postgres::Config, TlsSettings), String> {
    let (rest, options) = take_tls_options(url)?;
    let mut mode = None;
    let mut rootcert = None;
    for (key, value) in options {
        match key.as_str() {
            "sslmode" => {
                mode = Some(match value.as_str() {
                    "disable" => SslMode::Disable,
                    "prefer" => SslMode::Prefer,
                    "require" => SslMode::Require,
                    "verify-ca" => SslMode::VerifyCa,
                    "verify-full" => SslMode::VerifyFull,
                    "allow" => {
                        return Err(
                            "sslmode=allow is not supported (it tries plaintext first); \
                                    use sslmode=prefer or a stronger mode"
                                .to_owned(),
                        )
                    }
                    _ => {
                        return Err("invalid sslmode: expected disable, prefer, require, \
                                    verify-ca or verify-full"
                            .to_owned())
                    }
                })
            }
            "sslrootcert" => {
                if value.is_empty() {
                    return Err("sslrootcert must not be empty".to_owned());
                }
                rootcert = Some(value);
            }
            other => {
                let why = UNSUPPORTED
                    .iter()
                    .find(|(name, _)| *name == other)
                    .map(|(_, why)| *why)
                    .unwrap_or("not supported");
                return Err(format!("option `{other}` is not supported: {why}"));
            }
        }
    }

    // `sslrootcert=system` is explicit too: libpq allows it only with verification.
    let explicit_root = rootcert.is_some() || ca_file.is_some();
    let root = match (rootcert, ca_file) {
        (Some(_), Some(_)) => {
            return Err(
                "both sslrootcert and store.ca_file name a trust root: keep one of them".to_owned(),
            )
        }
        (Some(value), None) if value == "system" => TrustRoot::Bundled,
        (Some(value), None) => TrustRoot::File {
            path: PathBuf::from(value),
            origin: "sslrootcert",
        },
        (None, Some(path)) => TrustRoot::File {
            path: path.to_path_buf(),
            origin: "store.ca_file",
        },
        (None, None) => TrustRoot::Bundled,
    };
    let mode = mode.unwrap_or(SslMode::Prefer);
    if explicit_root && !mode.verifies() {
        return Err(format!(
            "a trust root (sslrootcert or store.ca_file) is only used with sslmode=verify-full \
             or verify-ca, and this sslmode is {}, which does not verify the server's \
             certificate: set sslmode=verify-full",
            mode.as_str()
        ));
    }

    let mut pg = tokio_postgres::Config::from_str(&rest).map_err(safe_parse_error)?;
    pg.ssl_mode(match mode {
        SslMode::Disable => tokio_postgres::config::SslMode::Disable,
        SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
        _ => tokio_postgres::config::SslMode::Require,
    });

    let unix_socket = pg
        .get_hosts()
        .iter()
        .any(|h| !matches!(h, tokio_postgres::config::Host::Tcp(_)));
    if mode == SslMode::VerifyFull && (unix_socket || pg.get_hosts().is_empty()) {
        return Err(
            "sslmode=verify-full needs a host name (or IP address) to check the server's \
             certificate against, and this host is a Unix socket or only a hostaddr: set host \
             to the name in the certificate, or use sslmode=verify-ca"
                .to_owned(),
        );
    }
    if matches!(mode, SslMode::Require | SslMode::VerifyCa) && unix_socket {
        return Err(format!(
            "sslmode={} with a Unix socket host: PostgreSQL does not offer TLS on Unix \
             sockets; use a TCP host, or sslmode=prefer",
            mode.as_str()
        ));
    }
    if pg.get_hosts().is_empty() && !pg.get_hostaddrs().is_empty() {
        // tokio-postgres takes the TLS server name from `host` and refuses a handshake
        // without one; with `hostaddr` alone the address is the name (it is connected to
        // either way).
        for addr in pg.get_hostaddrs().to_vec() {
            pg.host(addr.to_string());
        }
    }
    Ok((pg, TlsSettings { mode, root }))
}

/// tokio-postgres' parse error, reduced to what is safe to repeat: "invalid value for option
/// `name`" (its option names are fixed strings). Other messages, "unknown option" included,
/// quote characters of the input, which may be a password; the TLS options of libpq never
/// get here (see [`UNSUPPORTED`]).
fn safe_parse_error(e: tokio_postgres::Error) -> String {
    let detail = std::error::Error::source(&e)
        .map(ToString::to_string)
        .filter(|d| d.starts_with("invalid value for option"))
        .map(|d| format!(" ({d})"))
        .unwrap_or_default();
    format!(
        "not a valid PostgreSQL connection string{detail}; expected a postgres:// URL or \
         key=value pairs (the value is not shown: it may contain a password)"
    )
}

/// Whether `key` is an option this module reads or refuses.
fn is_tls_option(key: &str) -> bool {
    key == "sslmode" || key == "sslrootcert" || UNSUPPORTED.iter().any(|(k, _)| *k == key)
}

/// `url` without its TLS options, and those options (decoded), in order.
fn take_tls_options(url: &str) -> Result<(String, Vec<(String, String)>), String> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let Some((base, query)) = url.split_once('?') else {
            return Ok((url.to_owned(), Vec::new()));
        };
        let mut kept = Vec::new();
        let mut taken = Vec::new();
        for pair in query.split('&') {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let key = decode(key);
            if is_tls_option(&key) {
                taken.push((key, decode(value)));
            } else {
                kept.push(pair);
            }
        }
        let rest = if kept.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        return Ok((rest, taken));
    }
    // key=value form. A string that does not tokenise is left whole to tokio-postgres, whose
    // error is the one to report.
    let Some(pairs) = key_value_pairs(url) else {
        return Ok((url.to_owned(), Vec::new()));
    };
    let mut rest = String::with_capacity(url.len());
    let mut taken = Vec::new();
    let mut from = 0;
    for pair in pairs {
        if is_tls_option(&pair.key) {
            rest.push_str(&url[from..pair.start]);
            from = pair.end;
            taken.push((pair.key, pair.value));
        }
    }
    rest.push_str(&url[from..]);
    Ok((rest, taken))
}

fn decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

/// One `key = value` of a key=value connection string, with its byte span.
struct Pair {
    key: String,
    value: String,
    start: usize,
    end: usize,
}

/// Tokenises libpq's key=value syntax: whitespace-separated `key = value`, a value either
/// single-quoted (with `\'` and `\\`) or ending at whitespace (with `\` escaping). `None`
/// when the string does not follow it.
fn key_value_pairs(s: &str) -> Option<Vec<Pair>> {
    let bytes = s.as_bytes();
    let mut pairs = Vec::new();
    let mut i = 0;
    let skip_ws = |i: &mut usize| {
        while *i < bytes.len() && bytes[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    loop {
        skip_ws(&mut i);
        if i >= bytes.len() {
            return Some(pairs);
        }
        let start = i;
        while i < bytes.len() && bytes[i] != b'=' && !bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        let key = s[start..i].to_owned();
        skip_ws(&mut i);
        if i >= bytes.len() || bytes[i] != b'=' || key.is_empty() {
            return None;
        }
        i += 1;
        skip_ws(&mut i);
        let mut value = Vec::new();
        if i < bytes.len() && bytes[i] == b'\'' {
            i += 1;
            loop {
                match bytes.get(i)? {
                    b'\'' => {
                        i += 1;
                        break;
                    }
                    b'\\' => {
                        value.push(*bytes.get(i + 1)?);
                        i += 2;
                    }
                    b => {
                        value.push(*b);
                        i += 1;
                    }
                }
            }
        } else {
            while i < bytes.len() && !bytes[i].is_ascii_whitespace() {
                if bytes[i] == b'\\' {
                    value.push(*bytes.get(i + 1)?);
                    i += 2;
                } else {
                    value.push(bytes[i]);
                    i += 1;
                }
            }
        }
        pairs.push(Pair {
            key,
            value: String::from_utf8(value).ok()?,
            start,
            end: i,
        });
    }
}

impl TlsSettings {
    /// The connector for these settings. Reads the trust root's file: the error names the
    /// file and the setting it came from.
    pub fn connector(&self) -> Result<MakeRustls, Detail> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let roots = match &self.root {
            TrustRoot::Bundled => {
                let mut roots = RootCertStore::empty();
                roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
                roots
            }
            TrustRoot::File { path, origin } => {
                read_roots(path).map_err(|e| Detail::caused_by(format!("{origin}: {e}"), e))?
            }
        };
        let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .build()
            .map_err(|e| Detail::caused_by(format!("TLS trust root: {e}"), e))?;
        let verifier: Arc<dyn ServerCertVerifier> = match self.mode {
            SslMode::VerifyFull => webpki,
            SslMode::VerifyCa => Arc::new(ChainOnly(webpki)),
            // `prefer` and `require`: any certificate (libpq's meaning of these modes).
            _ => Arc::new(crate::tls::SignaturesOnly(provider.clone())),
        };
        let mut config = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|e| Detail::caused_by(format!("TLS configuration: {e}"), e))?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"postgresql".to_vec()];
        Ok(MakeRustls {
            config: Arc::new(config),
        })
    }
}

/// Every certificate of a PEM file, as a root store; at least one.
pub fn read_roots(path: &Path) -> Result<RootCertStore, Detail> {
    let bytes = std::fs::read(path)
        .map_err(|e| Detail::caused_by(format!("cannot read {}: {e}", path.display()), e))?;
    let mut roots = RootCertStore::empty();
    for item in CertificateDer::pem_slice_iter(&bytes) {
        let cert = item
            .map_err(|e| Detail::caused_by(format!("{}: malformed PEM: {e}", path.display()), e))?;
        roots.add(cert).map_err(|e| {
            Detail::caused_by(
                format!("{}: unusable CA certificate: {e}", path.display()),
                e,
            )
        })?;
    }
    if roots.is_empty() {
        return Err(format!(
            "{}: no certificate found (expected a PEM \"BEGIN CERTIFICATE\" block)",
            path.display()
        )
        .into());
    }
    Ok(roots)
}

/// `verify-ca`: the chain must lead to the trust root; the name is not checked (webpki checks
/// the chain first, so a name mismatch is the only error left to forgive).
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// tokio-postgres' TLS connector over tokio-rustls.
#[derive(Clone)]
pub struct MakeRustls {
    config: Arc<ClientConfig>,
}

impl fmt::Debug for MakeRustls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("MakeRustls")
    }
}

impl MakeTlsConnect<Socket> for MakeRustls {
    type Stream = RustlsStream;
    type TlsConnect = RustlsConnect;
    type Error = PgTlsError;

    fn make_tls_connect(&mut self, domain: &str) -> Result<RustlsConnect, PgTlsError> {
        let name = ServerName::try_from(domain.to_owned()).map_err(|_| PgTlsError::BadName)?;
        Ok(RustlsConnect {
            connector: tokio_rustls::TlsConnector::from(self.config.clone()),
            name,
        })
    }
}

/// One handshake, for one host.
pub struct RustlsConnect {
    connector: tokio_rustls::TlsConnector,
    name: ServerName<'static>,
}

impl TlsConnect<Socket> for RustlsConnect {
    type Stream = RustlsStream;
    type Error = PgTlsError;
    type Future = Pin<Box<dyn Future<Output = Result<RustlsStream, PgTlsError>> + Send>>;

    fn connect(self, stream: Socket) -> Self::Future {
        Box::pin(async move {
            self.connector
                .connect(self.name, stream)
                .await
                .map(RustlsStream)
                .map_err(PgTlsError::from_io)
        })
    }
}

/// Why a TLS handshake with the database failed.
#[derive(Debug, thiserror::Error)]
pub enum PgTlsError {
    #[error("the host is not a valid TLS server name")]
    BadName,
    #[error(transparent)]
    Handshake(rustls::Error),
    /// The connection failed mid-handshake (a network failure, classified by its I/O error).
    #[error("connection failed during the TLS handshake")]
    Io(#[source] io::Error),
}

impl PgTlsError {
    /// tokio-rustls reports rustls' errors inside an `io::Error`; take them out so they are
    /// classified as TLS, not network, failures.
    fn from_io(e: io::Error) -> PgTlsError {
        if e.get_ref().is_some_and(|inner| inner.is::<rustls::Error>()) {
            match e
                .into_inner()
                .map(|inner| inner.downcast::<rustls::Error>())
            {
                Some(Ok(tls)) => return PgTlsError::Handshake(*tls),
                Some(Err(other)) => return PgTlsError::Io(io::Error::other(other)),
                None => return PgTlsError::Io(io::Error::other("TLS handshake failed")),
            }
        }
        PgTlsError::Io(e)
    }
}

/// A TLS session with the database.
pub struct RustlsStream(tokio_rustls::client::TlsStream<Socket>);

impl AsyncRead for RustlsStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl AsyncWrite for RustlsStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

impl TlsStream for RustlsStream {
    fn channel_binding(&self) -> ChannelBinding {
        let (_, session) = self.0.get_ref();
        session
            .peer_certificates()
            .and_then(|chain| chain.first())
            .and_then(|leaf| tls_server_end_point(leaf.as_ref()))
            .map(ChannelBinding::tls_server_end_point)
            .unwrap_or_else(ChannelBinding::none)
    }
}

/// RFC 5929 `tls-server-end-point`: the hash of the server's certificate, with the hash of its
/// signature algorithm (SHA-256 in place of MD5 and SHA-1). `None` when the algorithm names
/// no hash of its own (RSA-PSS carries it in parameters, Ed25519 has none): then there is no
/// binding, and PostgreSQL computes none either.
fn tls_server_end_point(cert: &[u8]) -> Option<Vec<u8>> {
    use sha2::Digest as _;
    // Certificate ::= SEQUENCE { tbsCertificate, signatureAlgorithm, signatureValue }
    let (certificate, _) = der_element(cert, 0x30)?;
    let (_, after_tbs) = der_element(certificate, 0x30)?;
    let (algorithm, _) = der_element(after_tbs, 0x30)?;
    let (oid, _) = der_element(algorithm, 0x06)?;
    const RSA: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01];
    const ECDSA_SHA2: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03];
    const ECDSA_SHA1: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x01];
    enum Hash {
        Sha256,
        Sha384,
        Sha512,
    }
    let hash = if let Some(last) = oid.strip_prefix(RSA) {
        match last {
            // md5WithRSAEncryption, sha1WithRSAEncryption, sha256WithRSAEncryption
            [0x04] | [0x05] | [0x0b] => Hash::Sha256,
            [0x0c] => Hash::Sha384,
            [0x0d] => Hash::Sha512,
            _ => return None,
        }
    } else if let Some(last) = oid.strip_prefix(ECDSA_SHA2) {
        match last {
            [0x02] => Hash::Sha256,
            [0x03] => Hash::Sha384,
            [0x04] => Hash::Sha512,
            _ => return None,
        }
    } else if oid == ECDSA_SHA1 {
        Hash::Sha256
    } else {
        return None;
    };
    Some(match hash {
        Hash::Sha256 => sha2::Sha256::digest(cert).to_vec(),
        Hash::Sha384 => sha2::Sha384::digest(cert).to_vec(),
        Hash::Sha512 => sha2::Sha512::digest(cert).to_vec(),
    })
}

/// The contents of the DER element at the start of `input` if its tag is `tag`, and what
/// follows it.
fn der_element(input: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
    let (&found, rest) = input.split_first()?;
    if found != tag {
        return None;
    }
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, b| (acc << 8) | usize::from(*b));
        (len, &rest[n..])
    };
    (rest.len() >= len).then(|| rest.split_at(len))
}

/// When `e` is a TLS failure (the server declined TLS, or the handshake failed), what went
/// wrong and what to change; `None` for every other error.
pub fn tls_problem(e: &tokio_postgres::Error) -> Option<String> {
    use std::error::Error as _;
    let source = e.source()?;
    if let Some(tls) = source.downcast_ref::<PgTlsError>() {
        return match tls {
            PgTlsError::Handshake(err) => Some(handshake_problem(err)),
            PgTlsError::BadName => Some(format!("TLS: {tls}")),
            // A connection lost mid-handshake is a network failure.
            PgTlsError::Io(_) => None,
        };
    }
    // tokio-postgres' own TLS errors carry only a message.
    let message = source.to_string();
    if message == "server does not support TLS" {
        return Some(
            "server does not support TLS: sslmode=require (and verify-ca, verify-full) needs \
             ssl = on on the server, or use sslmode=prefer in store.url"
                .to_owned(),
        );
    }
    (e.to_string() == "error performing TLS handshake").then(|| format!("TLS: {message}"))
}

fn handshake_problem(err: &rustls::Error) -> String {
    match err {
        rustls::Error::InvalidCertificate(cert) => match cert {
            CertificateError::UnknownIssuer | CertificateError::BadSignature => format!(
                "certificate not trusted ({err}): set store.ca_file or sslrootcert to the CA \
                 that issued the database's certificate (your provider's CA bundle)"
            ),
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
                format!(
                    "certificate does not match the host name ({err}): connect by a name the \
                     certificate carries, or use sslmode=verify-ca"
                )
            }
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                format!("the database's certificate has expired ({err}): renew it on the server")
            }
            _ => format!("certificate rejected: {err}"),
        },
        _ => format!("TLS handshake failed: {err}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(url: &str) -> Result<TlsSettings, String> {
        parse(url, None).map(|(_, tls)| tls)
    }

    #[test]
    fn tls_options_are_taken_out_of_both_url_forms() {
        let (pg, tls) = parse(
            "postgres://u:pw@h/db?application_name=x&sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem",
            None,
        )
        .expect("parses");
        assert_eq!(tls.mode, SslMode::VerifyFull);
        assert_eq!(
            tls.root,
            TrustRoot::File {
                path: PathBuf::from("/etc/ca.pem"),
                origin: "sslrootcert"
            }
        );
        assert_eq!(pg.get_application_name(), Some("x"));
        assert_eq!(pg.get_ssl_mode(), tokio_postgres::config::SslMode::Require);

        let (pg, tls) = parse(
            "host=h sslrootcert = '/a b/c\\'s.pem' sslmode=verify-ca dbname=d",
            None,
        )
        .expect("parses");
        assert_eq!(tls.mode, SslMode::VerifyCa);
        assert_eq!(
            tls.root,
            TrustRoot::File {
                path: PathBuf::from("/a b/c's.pem"),
                origin: "sslrootcert"
            }
        );
        assert_eq!(pg.get_dbname(), Some("d"));
    }

    #[test]
    fn modes_and_their_defaults() {
        let (pg, tls) = parse("postgres://h/db", None).expect("parses");
        assert_eq!(tls.mode, SslMode::Prefer);
        assert_eq!(tls.root, TrustRoot::Bundled);
        assert_eq!(pg.get_ssl_mode(), tokio_postgres::config::SslMode::Prefer);
        let (pg, _) = parse("host=h sslmode=disable", None).expect("parses");
        assert_eq!(pg.get_ssl_mode(), tokio_postgres::config::SslMode::Disable);
        assert_eq!(
            settings("host=h sslmode=verify-full sslrootcert=system").map(|t| t.root),
            Ok(TrustRoot::Bundled)
        );
        assert!(settings("host=h sslmode=verify-partly")
            .expect_err("unknown")
            .contains("invalid sslmode"));
        assert!(settings("host=h sslmode=allow")
            .expect_err("allow")
            .contains("allow"));
    }

    #[test]
    fn checks_before_connecting() {
        let ca = Path::new("/ca.pem");
        assert!(parse("host=h sslmode=require", Some(ca))
            .expect_err("root without verification")
            .contains("sslmode=verify-full"));
        assert!(parse("host=h", Some(ca)).is_err(), "default prefer too");
        assert!(
            parse("host=h sslmode=verify-full sslrootcert=/x.pem", Some(ca))
                .expect_err("two roots")
                .contains("keep one")
        );
        assert!(settings("host=/run/postgresql sslmode=verify-full")
            .expect_err("socket")
            .contains("host name"));
        assert!(settings("hostaddr=10.0.0.1 sslmode=verify-full")
            .expect_err("hostaddr only")
            .contains("host name"));
        assert!(settings("host=/run/postgresql sslmode=require")
            .expect_err("socket")
            .contains("Unix socket"));
        assert!(
            settings("host=/run/postgresql").is_ok(),
            "prefer falls back"
        );
        assert!(settings("host=h sslmode=require sslrootcert=system").is_err());
        assert!(
            settings("host=10.0.0.1 sslmode=verify-full").is_ok(),
            "IP SANs"
        );
        let (pg, _) = parse("hostaddr=10.0.0.1 sslmode=require", None).expect("parses");
        assert_eq!(
            pg.get_hosts(),
            &[tokio_postgres::config::Host::Tcp("10.0.0.1".into())],
            "hostaddr becomes the TLS name"
        );
    }

    #[test]
    fn unsupported_options_are_named_and_nothing_else_is_echoed() {
        let err = settings("postgres://u:hunter2@h/db?sslcert=c.pem").expect_err("client cert");
        assert!(
            err.contains("`sslcert`") && err.contains("client certificates"),
            "{err}"
        );
        let err = settings("postgres://u:hunter2@h/db?bogus_hunter2=1").expect_err("unknown");
        assert!(!err.contains("hunter2"), "{err}");
        let err = settings("host=h port=x password=hunter2").expect_err("port");
        assert!(err.contains("`port`") && !err.contains("hunter2"), "{err}");
    }

    #[test]
    fn end_point_hash_follows_the_signature_algorithm() {
        use sha2::Digest as _;
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P384_SHA384).expect("key");
        let cert = rcgen::CertificateParams::new(vec!["db".to_owned()])
            .expect("params")
            .self_signed(&key)
            .expect("cert");
        assert_eq!(
            tls_server_end_point(cert.der()),
            Some(sha2::Sha384::digest(cert.der()).to_vec())
        );
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).expect("key");
        let cert = rcgen::CertificateParams::new(vec!["db".to_owned()])
            .expect("params")
            .self_signed(&key)
            .expect("cert");
        assert_eq!(
            tls_server_end_point(cert.der()),
            None,
            "Ed25519 names no hash"
        );
        assert_eq!(tls_server_end_point(b"\x30\x82\xff"), None, "truncated");
    }

    #[test]
    fn ca_files_must_hold_certificates() {
        let dir = std::env::temp_dir().join(format!("tollgate-pgtls-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let bad = dir.join("bad.pem");
        std::fs::write(&bad, "not pem").expect("write");
        let tls = TlsSettings {
            mode: SslMode::VerifyFull,
            root: TrustRoot::File {
                path: bad,
                origin: "store.ca_file",
            },
        };
        let err = tls.connector().expect_err("no certificate").to_string();
        assert!(
            err.starts_with("store.ca_file: ") && err.contains("no certificate"),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A trust root that cannot be read keeps the I/O error as the cause (issue 19), and the
    /// text still names the setting and the file.
    #[test]
    fn unreadable_trust_root_keeps_the_io_error_as_its_source() {
        let missing = std::env::temp_dir().join("tollgate-pg-tls-no-such-ca.pem");
        let tls = TlsSettings {
            mode: SslMode::VerifyFull,
            root: TrustRoot::File {
                path: missing.clone(),
                origin: "store.ca_file",
            },
        };
        let err = tls.connector().expect_err("the file does not exist");
        let text = err.to_string();
        assert!(text.starts_with("store.ca_file: cannot read "), "{text}");
        assert!(
            crate::error::sources(&err)
                .iter()
                .any(|e| e.is::<std::io::Error>()),
            "no io::Error under {text}"
        );
    }
}
