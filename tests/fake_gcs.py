"""A local fake of Google Cloud Storage that the real GCS clients talk to.

TensorFlow's GCS filesystem (tf.io.gfile, tf.data, tfds, etils.epath) has no
endpoint setting: it always calls https://www.googleapis.com and
https://storage.googleapis.com through its libcurl. libcurl honours
`HTTPS_PROXY` and TensorFlow's `CURL_CA_BUNDLE`, and TensorFlow skips OAuth
when `GOOGLE_AUTH_TOKEN_FOR_TESTING` is set. So this fake is an HTTP proxy
that answers `CONNECT` itself: it opens TLS with a certificate for the two
Google hosts, signed by a throwaway CA made with the `openssl` command, and
serves the subset of the JSON API the clients use over a local folder
(`ROOT/BUCKET/OBJECT`). tensorstore (orbax's arrays) goes through the same
proxy (`TENSORSTORE_CA_BUNDLE`).

google-cloud-storage (orbax asks it about the bucket) has an emulator setting,
`STORAGE_EMULATOR_HOST`: the same server answers it in plain HTTP.

What is served: bucket metadata and storage layout (a flat bucket); object
metadata, media download (Range, generation preconditions), listing (prefix,
delimiter, start/end offsets, pages); simple and resumable uploads (chunked
request bodies too); delete; rewrite/copy (the clients' rename).
Folder markers (objects named `dir/`) are empty local folders. Requests it
does not serve get 501; every request is logged to LOG, one JSON line each.

  server = FakeGcs(root, log)   # a child process on a free local port
  subprocess.run(cmd, env={**os.environ, **server.env})
  server.unhandled()            # requests it refused
  server.stop()

`python tests/fake_gcs.py ROOT LOG` serves in the foreground (it prints its
port and CA file as one JSON line).
"""

import datetime
import http.server
import itertools
import json
import os
import shutil
import socketserver
import ssl
import subprocess
import sys
import tempfile
import threading
import urllib.parse

HOSTS = ("storage.googleapis.com", "www.googleapis.com")


def make_certificates(folder):
  """(CA file, server certificate file, server key file) in `folder`."""
  ca_key, ca_pem = f"{folder}/ca.key", f"{folder}/ca.pem"
  key, csr, pem = f"{folder}/srv.key", f"{folder}/srv.csr", f"{folder}/srv.pem"
  ext = f"{folder}/srv.ext"
  with open(ext, "w") as f:
    f.write(
        "basicConstraints=CA:FALSE\n"
        "extendedKeyUsage=serverAuth\n"
        f"subjectAltName={','.join('DNS:' + h for h in HOSTS)}\n"
    )
  ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
  commands = [
      ["req", "-x509", *ec, "-keyout", ca_key, "-out", ca_pem]
      + ["-days", "2", "-subj", "/CN=fake-gcs test CA"]
      + ["-addext", "basicConstraints=critical,CA:TRUE"]
      + ["-addext", "keyUsage=critical,keyCertSign,cRLSign"],
      ["req", *ec, "-keyout", key, "-out", csr, "-subj", f"/CN={HOSTS[0]}"],
      ["x509", "-req", "-in", csr, "-CA", ca_pem, "-CAkey", ca_key]
      + ["-CAcreateserial", "-out", pem, "-days", "2", "-extfile", ext],
  ]
  for args in commands:
    subprocess.run(["openssl", *args], check=True, capture_output=True)
  return ca_pem, pem, key


class GcsError(Exception):

  def __init__(self, status, message):
    super().__init__(message)
    self.status = status


class Bucket:
  """Objects of the buckets under `root`: ROOT/BUCKET/NAME, thread-safe."""

  def __init__(self, root):
    self.root = os.path.abspath(root)
    self.lock = threading.RLock()
    # Folder markers written by a client (kept when their folder fills and
    # empties again); an empty local folder is a marker too.
    self.markers = set()

  def local(self, bucket, name=""):
    path = os.path.normpath(os.path.join(self.root, bucket, name))
    if not path.startswith(os.path.join(self.root, bucket)):
      raise GcsError(400, f"bad object name {name!r}")
    return path

  def check_bucket(self, bucket):
    if not os.path.isdir(self.local(bucket)):
      raise GcsError(404, f"no bucket {bucket!r}")

  def metadata(self, bucket, name):
    self.check_bucket(bucket)
    path = self.local(bucket, name)
    if name.endswith("/"):
      if not self._is_marker(bucket, name):
        raise GcsError(404, f"no object {name!r}")
      size, generation, mtime = 0, 1, os.stat(path).st_mtime
    elif os.path.isfile(path):
      st = os.stat(path)
      size, generation, mtime = st.st_size, st.st_mtime_ns, st.st_mtime
    else:
      raise GcsError(404, f"no object {name!r}")
    updated = datetime.datetime.fromtimestamp(mtime, datetime.timezone.utc)
    return {
        "kind": "storage#object",
        "bucket": bucket,
        "name": name,
        "id": f"{bucket}/{name}/{generation}",
        "size": str(size),
        "generation": str(generation),
        "metageneration": "1",
        "contentType": "application/octet-stream",
        "storageClass": "STANDARD",
        "updated": updated.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "timeCreated": updated.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
    }

  def _is_marker(self, bucket, name):
    path = self.local(bucket, name)
    return os.path.isdir(path) and (
        (bucket, name) in self.markers or not os.listdir(path)
    )

  def check_preconditions(self, bucket, name, query):
    """412 where ifGenerationMatch fails; 304 where ifGenerationNotMatch."""
    try:
      generation = self.metadata(bucket, name)["generation"]
    except GcsError:
      generation = "0"
    if "ifGenerationMatch" in query:
      if query["ifGenerationMatch"] != generation:
        raise GcsError(412, "ifGenerationMatch failed")
    if query.get("ifGenerationNotMatch") == generation:
      raise GcsError(304, "")

  def read(self, bucket, name):
    with self.lock:
      meta = self.metadata(bucket, name)
      if name.endswith("/"):
        return meta, b""
      with open(self.local(bucket, name), "rb") as f:
        return meta, f.read()

  def write(self, bucket, name, data, query):
    with self.lock:
      self.check_bucket(bucket)
      self.check_preconditions(bucket, name, query)
      path = self.local(bucket, name)
      if name.endswith("/"):
        if data:
          raise GcsError(400, "a folder marker has no content")
        os.makedirs(path, exist_ok=True)
        self.markers.add((bucket, name))
        return self.metadata(bucket, name)
      old = os.stat(path).st_mtime_ns if os.path.isfile(path) else 0
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path, "wb") as f:
        f.write(data)
      if os.stat(path).st_mtime_ns <= old:  # A new generation, always.
        os.utime(path, ns=(old + 1, old + 1))
      return self.metadata(bucket, name)

  def delete(self, bucket, name, query):
    with self.lock:
      self.check_preconditions(bucket, name, query)
      self.metadata(bucket, name)  # 404 where missing.
      path = self.local(bucket, name)
      if name.endswith("/"):
        self.markers.discard((bucket, name))
        if not os.listdir(path):
          os.rmdir(path)
      else:
        os.remove(path)
      # Folders that only held the object vanish with it, as on GCS.
      parent = os.path.dirname(path.rstrip("/"))
      while parent != self.local(bucket) and not os.listdir(parent):
        rel = os.path.relpath(parent, self.local(bucket)) + "/"
        if (bucket, rel) in self.markers:
          break
        os.rmdir(parent)
        parent = os.path.dirname(parent)

  def names(self, bucket, prefix):
    """Every object name under `prefix`'s folder, sorted."""
    self.check_bucket(bucket)
    top = prefix.rsplit("/", 1)[0] + "/" if "/" in prefix else ""
    start = self.local(bucket, top)
    out = []
    for folder, dirs, files in os.walk(start):
      rel = os.path.relpath(folder, self.local(bucket))
      rel = "" if rel == "." else rel + "/"
      if rel and self._is_marker(bucket, rel):
        out.append(rel)
      out.extend(rel + f for f in files)
      dirs.sort()
    return sorted(n for n in out if n.startswith(prefix))

  def listing(self, bucket, query):
    prefix = query.get("prefix", "")
    delimiter = query.get("delimiter")
    with self.lock:
      names = self.names(bucket, prefix)
      names = [n for n in names if n >= query.get("startOffset", "")]
      if "endOffset" in query:
        names = [n for n in names if n < query["endOffset"]]
      entries = []  # (name, is a prefix), sorted, prefixes once each.
      for name in names:
        cut = name.find(delimiter, len(prefix)) if delimiter else -1
        if cut < 0:
          entries.append((name, False))
        elif not entries or entries[-1] != (name[: cut + 1], True):
          entries.append((name[: cut + 1], True))
      token = query.get("pageToken", "")
      entries = [e for e in entries if e[0] > token]
      size = int(query.get("maxResults", 1000))
      page = entries[:size]
      out = {"kind": "storage#objects"}
      items = [
          self.metadata(bucket, n) for n, is_prefix in page if not is_prefix
      ]
      prefixes = [n for n, is_prefix in page if is_prefix]
      if items:
        out["items"] = items
      if prefixes:
        out["prefixes"] = prefixes
      if len(entries) > size:
        out["nextPageToken"] = page[-1][0]
      return out


def split_path(raw):
  """URL path -> its segments, each %-decoded (object names hold %2F)."""
  return [urllib.parse.unquote(s) for s in raw.split("/")[1:]]


class Handler(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"
  server_version = "fake-gcs"
  tunnel_host = None

  def log_message(self, *args):  # Quiet; requests go to the log file.
    pass

  def do_CONNECT(self):
    host = self.path.split(":")[0]
    if host not in HOSTS:
      self.send_response(403)
      self.send_header("Content-Length", "0")
      self.end_headers()
      return
    self.send_response(200, "Connection established")
    self.end_headers()
    self.wfile.flush()
    self.request = self.connection = self.server.tls.wrap_socket(
        self.connection, server_side=True
    )
    self.tunnel_host = host
    self.setup()  # New rfile/wfile on the TLS socket.

  def do_GET(self):
    self.dispatch()

  def do_POST(self):
    self.dispatch()

  def do_PUT(self):
    self.dispatch()

  def do_DELETE(self):
    self.dispatch()

  def dispatch(self):
    url = urllib.parse.urlsplit(self.path)
    query = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
    body = self.body()
    try:
      self.route(split_path(url.path), query, body)
    except GcsError as e:
      self.reply(e.status, {"error": {"code": e.status, "message": str(e)}})

  def body(self):
    """The request's body, chunked (as TensorFlow's uploads send) or not."""
    if self.headers.get("Transfer-Encoding", "").lower() != "chunked":
      return self.rfile.read(int(self.headers.get("Content-Length", 0)))
    chunks = []
    while size := int(self.rfile.readline().split(b";")[0], 16):
      chunks.append(self.rfile.read(size))
      self.rfile.readline()
    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
      pass  # Trailers.
    return b"".join(chunks)

  def route(self, parts, query, body):
    store, method = self.server.store, self.command
    if parts[:2] == ["storage", "v1"] and len(parts) >= 4 and parts[2] == "b":
      bucket, rest = parts[3], parts[4:]
      if not rest and method == "GET":
        store.check_bucket(bucket)
        return self.reply(200, {"kind": "storage#bucket", "name": bucket})
      if rest == ["storageLayout"] and method == "GET":
        store.check_bucket(bucket)
        # A flat bucket (no hierarchical namespace): renames copy objects.
        layout = {"kind": "storage#storageLayout", "bucket": bucket}
        return self.reply(200, layout)
      if rest == ["o"] and method == "GET":
        return self.reply(200, store.listing(bucket, query))
      if len(rest) == 2 and rest[0] == "o":
        return self.object(bucket, rest[1], query)
      if (
          len(rest) == 7
          and rest[2] in ("rewriteTo", "copyTo")
          and method == "POST"
      ):
        return self.copy(bucket, rest[1], rest[4], rest[6], query)
    if parts[:3] == ["upload", "storage", "v1"] and parts[3:6:2] == ["b", "o"]:
      return self.upload(parts[4], query, body)
    if self.tunnel_host == HOSTS[0] and len(parts) >= 2 and method == "GET":
      # storage.googleapis.com/BUCKET/OBJECT: TensorFlow's reads.
      return self.media(parts[0], "/".join(parts[1:]), query)
    raise GcsError(501, f"fake-gcs does not serve {method} {self.path}")

  def object(self, bucket, name, query):
    store = self.server.store
    if self.command == "DELETE":
      store.delete(bucket, name, query)
      return self.reply(204, None)
    if self.command != "GET":
      raise GcsError(405, f"{self.command} on an object")
    if query.get("alt") == "media":
      return self.media(bucket, name, query)
    store.check_preconditions(bucket, name, query)
    return self.reply(200, store.metadata(bucket, name))

  def media(self, bucket, name, query):
    store = self.server.store
    store.check_preconditions(bucket, name, query)
    meta, data = store.read(bucket, name)
    headers = {
        "x-goog-generation": meta["generation"],
        "x-goog-metageneration": "1",
        "x-goog-stored-content-length": meta["size"],
        "ETag": f'"{meta["generation"]}"',
    }
    byte_range = self.headers.get("Range")
    if not byte_range or not data:
      return self.reply(200, data, headers)
    first, last = byte_range.removeprefix("bytes=").split("-")
    if first == "":  # bytes=-N: the last N bytes.
      first, last = max(0, len(data) - int(last)), len(data) - 1
    first = int(first)
    last = min(int(last), len(data) - 1) if last else len(data) - 1
    if first >= len(data):
      headers["Content-Range"] = f"bytes */{len(data)}"
      return self.reply(416, b"", headers)
    headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
    return self.reply(206, data[first : last + 1], headers)

  def copy(self, src_bucket, src, dst_bucket, dst, query):
    store = self.server.store
    _, data = store.read(src_bucket, src)
    meta = store.write(dst_bucket, dst, data, query)
    return self.reply(
        200,
        {
            "kind": "storage#rewriteResponse",
            "done": True,
            "totalBytesRewritten": meta["size"],
            "objectSize": meta["size"],
            "resource": meta,
        },
    )

  def upload(self, bucket, query, body):
    store, kind = self.server.store, query.get("uploadType")
    if self.command == "POST" and kind == "media":
      return self.reply(200, store.write(bucket, query["name"], body, query))
    if self.command == "POST" and kind == "resumable":
      name = query.get("name") or json.loads(body or b"{}")["name"]
      upload_id = str(next(self.server.upload_ids))
      self.server.uploads[upload_id] = (name, query)
      scheme_host = (
          f"https://{self.tunnel_host}"
          if self.tunnel_host
          else f"http://{self.headers['Host']}"
      )
      location = (
          f"{scheme_host}/upload/storage/v1/b/{bucket}/o"
          f"?uploadType=resumable&upload_id={upload_id}"
      )
      return self.reply(200, b"", {"Location": location})
    if self.command == "PUT" and query.get("upload_id") in self.server.uploads:
      # The clients here send the whole object in one PUT
      # (Content-Range: bytes 0-N/TOTAL, or bytes */0 when empty).
      name, first_query = self.server.uploads[query["upload_id"]]
      content_range = self.headers.get("Content-Range", "")
      total = content_range.rsplit("/", 1)[-1]
      if total == "*" or len(body) != int(total):
        raise GcsError(501, f"partial upload chunk {content_range!r}")
      meta = store.write(bucket, name, body, first_query)
      del self.server.uploads[query["upload_id"]]
      return self.reply(200, meta)
    raise GcsError(501, f"upload {self.command} {self.path}")

  def reply(self, status, payload, headers=None):
    if isinstance(payload, dict):
      payload = json.dumps(payload).encode()
      headers = {"Content-Type": "application/json", **(headers or {})}
    # 204 and 304 have no body: one would be read as the next reply.
    payload = b"" if status in (204, 304) else payload or b""
    entry = [self.command, self.tunnel_host, self.path, status]
    self.server.log.write(json.dumps(entry) + "\n")
    self.send_response(status)
    for key, value in (headers or {}).items():
      self.send_header(key, value)
    self.send_header("Content-Length", str(len(payload)))
    self.end_headers()
    if self.command != "HEAD":
      self.wfile.write(payload)


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
  daemon_threads = True
  allow_reuse_address = True


def serve(root, log, ready):
  """Serves ROOT until killed; says {"port", "ca"} on `ready` (a stream)."""
  certs = tempfile.mkdtemp(prefix="fake-gcs-certs-")
  ca, cert, key = make_certificates(certs)
  httpd = Server(("127.0.0.1", 0), Handler)
  httpd.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
  httpd.tls.load_cert_chain(cert, key)
  httpd.tls.set_alpn_protocols(["http/1.1"])
  httpd.store = Bucket(root)
  httpd.log = open(log, "a", buffering=1)  # One JSON line per request.
  httpd.uploads = {}
  httpd.upload_ids = itertools.count(1)
  ready.write(json.dumps({"port": httpd.server_address[1], "ca": ca}) + "\n")
  ready.flush()
  try:
    httpd.serve_forever()
  finally:
    shutil.rmtree(certs, ignore_errors=True)


class FakeGcs:
  """The fake in a child process on 127.0.0.1 (a free port).

  A child process, not a thread: TensorFlow calls that hold the GIL while they
  wait on the network (TFRecordWriter's close) would wait for ever on a
  server thread of the same process.
  """

  def __init__(self, root, log):
    self.root, self.log = root, log
    self.proc = subprocess.Popen(
        [sys.executable, __file__, root, log],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"fake-gcs did not start (exit {self.proc.wait()})")
    ready = json.loads(line)
    self.port, self.ca = ready["port"], ready["ca"]

  def requests(self):
    """[(method, host, path, status)] served so far."""
    if not os.path.exists(self.log):
      return []
    with open(self.log) as f:
      return [tuple(json.loads(line)) for line in f]

  def unhandled(self):
    return [r for r in self.requests() if r[3] == 501]

  @property
  def env(self):
    """The variables that send a process's GCS clients here."""
    proxy = f"http://127.0.0.1:{self.port}"
    return {
        "HTTPS_PROXY": proxy,
        "https_proxy": proxy,
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        "CURL_CA_BUNDLE": self.ca,
        "TENSORSTORE_CA_BUNDLE": self.ca,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake-gcs-token",
        # google-cloud-storage (orbax asks it whether the bucket has a
        # hierarchical namespace) has an emulator setting: plain HTTP here.
        "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{self.port}",
        # Fail fast: a refused request is a bug here, not a network blip.
        "GCS_RETRY_CONFIG_MAX_RETRIES": "1",
        "GCS_RETRY_CONFIG_INIT_DELAY_TIME_US": "1000",
        "GCS_RETRY_CONFIG_MAX_DELAY_TIME_US": "1000",
    }

  def stop(self):
    self.proc.terminate()
    self.proc.wait()


def main():
  if len(sys.argv) != 3:
    sys.exit("usage: python tests/fake_gcs.py ROOT LOG  (ROOT/BUCKET/...)")
  serve(sys.argv[1], sys.argv[2], sys.stdout)


if __name__ == "__main__":
  main()
