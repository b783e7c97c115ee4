"""A real TLS reverse proxy for tests: Debian's nginx with a private config and prefix.

`make_pki` makes a CA and a server certificate for 127.0.0.1/localhost with the
`cryptography` package; `Nginx` starts nginx as the current user (`daemon off`,
`master_process off`, pid, logs and temp paths under a tmp dir, no system-wide config)
on a free loopback port, in front of an upstream, with an API-key check and two path
prefixes: `/llm/` with `proxy_buffering off` and `/buffered/` with a large buffer.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).is_file()), None
    )


@dataclass(frozen=True)
class Pki:
    ca_file: Path
    cert_file: Path
    key_file: Path
    other_ca_file: Path  # a CA that did not sign the server's certificate


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _ca(cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    return key, cert


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def make_pki(tmp: Path) -> Pki:
    ca_key, ca = _ca("calculet-load test CA")
    _, other = _ca("calculet-load untrusted CA")
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("localhost"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    tmp.mkdir(parents=True, exist_ok=True)
    pki = Pki(tmp / "ca.pem", tmp / "server.pem", tmp / "server.key", tmp / "other-ca.pem")
    pki.ca_file.write_bytes(_pem(ca))
    pki.other_ca_file.write_bytes(_pem(other))
    pki.cert_file.write_bytes(_pem(cert))
    pki.key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return pki


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_CONFIG = """\
daemon off;
master_process off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log info;
events {{ worker_connections 512; }}
http {{
    access_log {d}/access.log;
    client_body_temp_path {d}/client_body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    keepalive_timeout 60s;
    upstream sim {{
        server {upstream};
        keepalive 16;
    }}
    server {{
        listen 127.0.0.1:{port} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        location /llm/ {{
            if ($http_authorization != "Bearer {api_key}") {{ return 401; }}
            proxy_pass http://sim/;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Authorization "";
            proxy_buffering off;
        }}
        location /buffered/ {{
            if ($http_authorization != "Bearer {api_key}") {{ return 401; }}
            proxy_pass http://sim/;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Authorization "";
            proxy_buffering on;
            proxy_buffer_size 64k;
            proxy_buffers 64 64k;
            proxy_busy_buffers_size 1m;
            proxy_max_temp_file_size 0;
        }}
    }}
}}
"""


@dataclass
class Nginx:
    """nginx on a free loopback port in front of `upstream` (host:port)."""

    tmp: Path
    upstream: str
    pki: Pki
    api_key: str
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    logs: list[Path] = field(default_factory=list)

    def start(self) -> Nginx:
        binary = nginx_binary()
        assert binary is not None
        d = self.tmp / f"nginx-{time.monotonic_ns()}"
        d.mkdir(parents=True)
        self.logs = [d / "error.log", d / "access.log", d / "stderr.log"]
        for attempt in range(5):  # a free port may be taken between the probe and nginx
            self.port = _free_port()
            conf = d / "nginx.conf"
            conf.write_text(
                _CONFIG.format(
                    d=d, port=self.port, upstream=self.upstream, cert=self.pki.cert_file,
                    key=self.pki.key_file, api_key=self.api_key,
                )
            )  # fmt: skip
            with open(d / "stderr.log", "ab") as err:
                self.proc = subprocess.Popen(
                    [binary, "-p", str(d), "-c", str(conf), "-e", str(d / "error.log")],
                    stdout=err,
                    stderr=err,
                )
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                    return self
                except OSError:
                    time.sleep(0.05)
            self.stop()
            if attempt == 4:
                raise RuntimeError(f"nginx did not start: {(d / 'error.log').read_text()}")
        return self

    def url(self, prefix: str = "/llm") -> str:
        return f"https://127.0.0.1:{self.port}{prefix}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: fast shutdown
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
