//! A private CA and server certificates for TLS tests, written as PEM files, and clients that
//! trust only what the test says.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use tollgate::testing::config::CertConfig;

pub struct TestPki {
    /// The CA certificate (PEM): an upstream's `ca_file`, or a test client's root.
    pub ca_file: PathBuf,
    pub dir: PathBuf,
    ca: rcgen::Certificate,
    ca_key: KeyPair,
}

impl Drop for TestPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl TestPki {
    /// A fresh CA in a new directory under the system temp dir.
    pub fn new() -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("tollgate-pki-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create pki dir");
        let ca_key = KeyPair::generate().expect("CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = params.self_signed(&ca_key).expect("CA certificate");
        let ca_file = write(&dir, "ca.pem", &ca.pem());
        Self {
            ca_file,
            dir,
            ca,
            ca_key,
        }
    }

    /// A certificate for `names` (DNS names, wildcards or IP addresses) signed by the CA:
    /// `<stem>.pem` holds leaf + CA, `<stem>.key` a PKCS#8 EC key.
    pub fn issue(&self, stem: &str, names: &[&str]) -> CertConfig {
        let key = KeyPair::generate().expect("leaf key");
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let leaf = CertificateParams::new(names)
            .expect("leaf params")
            .signed_by(&key, &self.ca, &self.ca_key)
            .expect("sign leaf");
        let chain = leaf.pem() + &self.ca.pem();
        CertConfig {
            cert: write(&self.dir, &format!("{stem}.pem"), &chain),
            key: write(&self.dir, &format!("{stem}.key"), &key.serialize_pem()),
        }
    }

    /// The DER of the leaf certificate in `cert`'s chain file.
    pub fn leaf_der(cert: &CertConfig) -> Vec<u8> {
        let pem = std::fs::read(&cert.cert).expect("read cert");
        let first = CertificateDer::pem_slice_iter(&pem)
            .next()
            .expect("a certificate")
            .expect("valid PEM");
        first.as_ref().to_vec()
    }
}

fn write(dir: &Path, name: &str, contents: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, contents).expect("write PEM");
    path
}
