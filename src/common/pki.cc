// The cluster's certificates on OpenSSL's libcrypto; see pki.h.
#include "common/pki.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/asn1.h>
#include <openssl/bio.h>
#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/file_system.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace ckpt::pki {
namespace {

constexpr std::string_view kScheme = "ckpt://";
constexpr std::string_view kJobKind = "job";
constexpr std::string_view kHostKind = "host";
constexpr size_t kMaxLabelLength = 63;
constexpr int kMaxDays = 36500;
// Certificates start an hour back so that a peer whose clock is a little
// behind the issuer's accepts them at once.
constexpr long kBackdateSeconds = 3600;

absl::string_view AV(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// ---------------------------------------------------------------------------
// OpenSSL objects owned by unique_ptr.

template <typename T, void (*F)(T*)>
struct Deleter {
  void operator()(T* p) const { F(p); }
};
using PkeyPtr = std::unique_ptr<EVP_PKEY, Deleter<EVP_PKEY, EVP_PKEY_free>>;
using X509Ptr = std::unique_ptr<X509, Deleter<X509, X509_free>>;
using BioPtr = std::unique_ptr<BIO, Deleter<BIO, BIO_free_all>>;
using ExtPtr = std::unique_ptr<X509_EXTENSION, Deleter<X509_EXTENSION, X509_EXTENSION_free>>;
using BnPtr = std::unique_ptr<BIGNUM, Deleter<BIGNUM, BN_free>>;
using Asn1IntPtr = std::unique_ptr<ASN1_INTEGER, Deleter<ASN1_INTEGER, ASN1_INTEGER_free>>;

void FreeGeneralNames(GENERAL_NAMES* names) { GENERAL_NAMES_free(names); }
using GeneralNamesPtr = std::unique_ptr<GENERAL_NAMES, Deleter<GENERAL_NAMES, FreeGeneralNames>>;
void FreeEku(EXTENDED_KEY_USAGE* eku) { sk_ASN1_OBJECT_pop_free(eku, ASN1_OBJECT_free); }
using EkuPtr = std::unique_ptr<EXTENDED_KEY_USAGE, Deleter<EXTENDED_KEY_USAGE, FreeEku>>;
void FreeBasicConstraints(BASIC_CONSTRAINTS* bc) { BASIC_CONSTRAINTS_free(bc); }
using BasicConstraintsPtr =
    std::unique_ptr<BASIC_CONSTRAINTS, Deleter<BASIC_CONSTRAINTS, FreeBasicConstraints>>;

// `what` and the reasons OpenSSL queued (the queue is emptied).
absl::Status OpensslError(std::string_view what) {
  std::string reasons;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof(buf));
    absl::StrAppend(&reasons, reasons.empty() ? "" : "; ", buf);
  }
  return absl::InternalError(absl::StrCat(AV(what), reasons.empty() ? "" : ": ", reasons));
}

absl::StatusOr<std::string> BioToString(BIO* bio) {
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  if (n < 0) return OpensslError("reading a memory BIO");
  return std::string(data, static_cast<size_t>(n));
}

absl::StatusOr<std::string> CertToPem(X509* cert) {
  BioPtr bio(BIO_new(BIO_s_mem()));
  if (!bio || PEM_write_bio_X509(bio.get(), cert) != 1) return OpensslError("encoding a certificate");
  return BioToString(bio.get());
}

absl::StatusOr<std::string> KeyToPem(EVP_PKEY* key) {
  BioPtr bio(BIO_new(BIO_s_mem()));
  // PKCS#8 ("BEGIN PRIVATE KEY"), unencrypted: what gRPC and OpenSSL read.
  if (!bio || PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0, nullptr, nullptr) != 1) {
    return OpensslError("encoding a private key");
  }
  return BioToString(bio.get());
}

absl::StatusOr<PkeyPtr> NewKey() {
  PkeyPtr key(EVP_EC_gen("P-256"));
  if (!key) return OpensslError("generating an EC P-256 key");
  return key;
}

// 128 random bits, positive and non-zero (RFC 5280 4.1.2.2: at most 20
// octets, positive).
absl::Status SetRandomSerial(X509* cert) {
  unsigned char bytes[16];
  if (RAND_bytes(bytes, sizeof(bytes)) != 1) return OpensslError("drawing a serial number");
  bytes[0] &= 0x7f;
  bytes[0] |= 0x40;  // never zero, always 16 bytes long
  BnPtr bn(BN_bin2bn(bytes, sizeof(bytes), nullptr));
  if (!bn) return OpensslError("drawing a serial number");
  Asn1IntPtr serial(BN_to_ASN1_INTEGER(bn.get(), nullptr));
  if (!serial || X509_set_serialNumber(cert, serial.get()) != 1) return OpensslError("setting the serial number");
  return absl::OkStatus();
}

absl::Status SetCommonName(X509_NAME* name, std::string_view cn) {
  // X.520 caps a CN at 64 characters; OpenSSL refuses longer ones.
  const std::string value(cn.substr(0, 64));
  if (X509_NAME_add_entry_by_NID(name, NID_commonName, MBSTRING_UTF8,
                                 reinterpret_cast<const unsigned char*>(value.data()),
                                 static_cast<int>(value.size()), -1, 0) != 1) {
    return OpensslError("setting the subject name");
  }
  return absl::OkStatus();
}

// Adds an extension written as openssl.cnf writes it ("critical,CA:TRUE").
absl::Status AddExtension(X509* cert, X509* issuer, int nid, const char* value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  ExtPtr ext(X509V3_EXT_conf_nid(nullptr, &ctx, nid, value));
  if (!ext || X509_add_ext(cert, ext.get(), -1) != 1) {
    return OpensslError(absl::StrCat("adding extension ", OBJ_nid2sn(nid), "=", value));
  }
  return absl::OkStatus();
}

// Validity: from an hour ago for `days` days, but not past `not_after_cap`
// when given (the CA's own end).
absl::Status SetValidity(X509* cert, int days, const ASN1_TIME* not_after_cap) {
  if (X509_gmtime_adj(X509_getm_notBefore(cert), -kBackdateSeconds) == nullptr ||
      X509_time_adj_ex(X509_getm_notAfter(cert), days, 0, nullptr) == nullptr) {
    return OpensslError("setting the validity");
  }
  if (not_after_cap != nullptr && X509_cmp_time(not_after_cap, nullptr) > 0) {
    int day = 0, sec = 0;
    if (ASN1_TIME_diff(&day, &sec, not_after_cap, X509_get0_notAfter(cert)) == 1 && (day > 0 || sec > 0)) {
      if (X509_set1_notAfter(cert, not_after_cap) != 1) return OpensslError("setting the validity");
    }
  }
  return absl::OkStatus();
}

absl::Status CheckDays(int days) {
  if (days < 1 || days > kMaxDays) {
    return absl::InvalidArgumentError(absl::StrCat("days must be 1 to ", kMaxDays, ", not ", days));
  }
  return absl::OkStatus();
}

int64_t AsnTimeToUnix(const ASN1_TIME* t) {
  struct tm tm;
  std::memset(&tm, 0, sizeof(tm));
  if (ASN1_TIME_to_tm(t, &tm) != 1) return 0;
  return static_cast<int64_t>(timegm(&tm));
}

// ---------------------------------------------------------------------------
// Files.

// Files claimed with O_EXCL and written whole, or removed: the destructor
// unlinks every file not committed, so a failure anywhere leaves none behind.
class NewFiles {
 public:
  NewFiles() = default;
  NewFiles(const NewFiles&) = delete;
  NewFiles& operator=(const NewFiles&) = delete;
  ~NewFiles() {
    for (File& f : files_) {
      if (f.fd >= 0) ::close(f.fd);
      if (!committed_) ::unlink(f.path.c_str());
    }
  }

  // Creates `path` exclusively (no symbolic link followed) with exactly
  // `mode`, whatever the umask. Returns its index.
  absl::StatusOr<size_t> Claim(const std::string& path, mode_t mode) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode & 0600);
    if (fd < 0) {
      const int e = errno;
      if (e == EEXIST) {
        return absl::AlreadyExistsError(absl::StrCat(
            "\"", path, "\" already exists; nothing was overwritten (remove it, or choose another name)"));
      }
      return PosixErrorToStatus(e, "create", path);
    }
    files_.push_back(File{path, fd});
    if (::fchmod(fd, mode) != 0) return PosixErrorToStatus(errno, "chmod", path);
    return files_.size() - 1;
  }

  absl::Status Write(size_t i, std::string_view data) {
    File& f = files_[i];
    while (!data.empty()) {
      const ssize_t n = ::write(f.fd, data.data(), data.size());
      if (n < 0) {
        if (errno == EINTR) continue;
        return PosixErrorToStatus(errno, "write", f.path);
      }
      data.remove_prefix(static_cast<size_t>(n));
    }
    if (::fsync(f.fd) != 0) return PosixErrorToStatus(errno, "fsync", f.path);
    return absl::OkStatus();
  }

  // Closes every file (their names stay) and syncs `dir`, which holds them.
  absl::Status Commit(const std::string& dir) {
    for (File& f : files_) {
      const int fd = std::exchange(f.fd, -1);
      if (::close(fd) != 0) return PosixErrorToStatus(errno, "close", f.path);
    }
    const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) return PosixErrorToStatus(errno, "open", dir);
    const int rc = ::fsync(dfd);
    const int e = errno;
    ::close(dfd);
    if (rc != 0) return PosixErrorToStatus(e, "fsync", dir);
    committed_ = true;
    return absl::OkStatus();
  }

 private:
  struct File {
    std::string path;
    int fd;
  };
  std::vector<File> files_;
  bool committed_ = false;
};

std::string DirOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// mkdir -p with mode 0700 for every directory it makes; existing ones are
// left as they are.
absl::Status MakeDirs(const std::string& dir) {
  if (dir.empty() || dir == "." || dir == "/") return absl::OkStatus();
  struct stat st;
  if (::stat(dir.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) {
      return absl::FailedPreconditionError(absl::StrCat("\"", dir, "\" exists and is not a directory"));
    }
    return absl::OkStatus();
  }
  CKPT_RETURN_IF_ERROR(MakeDirs(DirOf(dir)));
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return PosixErrorToStatus(errno, "mkdir", dir);
  return absl::OkStatus();
}

// The CA key: opened without following a symbolic link, then checked on the
// descriptor (no race between the check and the read).
absl::StatusOr<std::string> ReadCaKey(const std::string& path, const std::string& ca_dir) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) {
    const int e = errno;
    if (e == ENOENT) {
      return absl::NotFoundError(absl::StrCat("CA key \"", path, "\" does not exist (make the CA with `ckptctl certs create-ca --dir ",
                                              ca_dir, "`)"));
    }
    if (e == ELOOP) {
      return absl::FailedPreconditionError(
          absl::StrCat("CA key \"", path, "\" is a symbolic link: put the key file itself there"));
    }
    return PosixErrorToStatus(e, "open", path);
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) return PosixErrorToStatus(errno, "fstat", path);
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("CA key \"", path, "\" is not a regular file"));
  }
  if (st.st_uid != ::geteuid()) {
    return absl::FailedPreconditionError(absl::StrCat("CA key \"", path, "\" is owned by uid ", st.st_uid,
                                                      ", not by this user (uid ", ::geteuid(),
                                                      "): run as its owner, or chown it"));
  }
  if ((st.st_mode & 0177) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return absl::FailedPreconditionError(absl::StrCat("CA key \"", path, "\" has mode ", mode,
                                                      ", wider than 0600: chmod 600 ", path));
  }
  std::string text;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      return PosixErrorToStatus(errno, "read", path);
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (text.size() > (1 << 20)) {
      return absl::FailedPreconditionError(absl::StrCat("CA key \"", path, "\" is larger than 1 MiB: not a key"));
    }
  }
  return text;
}

absl::StatusOr<std::string> ReadCaCert(const std::string& path, const std::string& ca_dir) {
  absl::StatusOr<std::string> text = ReadFileToString(PosixFileSystem(), path);
  if (absl::IsNotFound(text.status())) {
    return absl::NotFoundError(absl::StrCat("CA certificate \"", path,
                                            "\" does not exist (make the CA with `ckptctl certs create-ca --dir ",
                                            ca_dir, "`)"));
  }
  return text;
}


// ---------------------------------------------------------------------------
// Names and URIs.

bool IsLabelChar(char c) { return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-'; }

absl::Status ValidateLabel(Role role, std::string_view name) {
  const auto bad = [&](std::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(AV(RoleName(role)), " name ", QuoteForMessage(name), " is invalid: ",
                                                   AV(why), "; names must match [A-Za-z0-9._-]{1,63}"));
  };
  if (name.empty()) return bad("it is empty");
  if (name.size() > kMaxLabelLength) return bad(absl::StrCat("it is ", name.size(), " bytes long"));
  if (!std::all_of(name.begin(), name.end(), IsLabelChar)) return bad("it has a character outside that set");
  if (name == "." || name == "..") return bad("it is a dot segment");
  return absl::OkStatus();
}

bool IsHostLabel(std::string_view label) {
  if (label.empty() || label.size() > 63 || label.front() == '-' || label.back() == '-') return false;
  return std::all_of(label.begin(), label.end(),
                     [](char c) { return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-'; });
}

// A host for subjectAltName: an IP literal (4 or 16 bytes in `ip`) or a DNS
// name (letters, digits and '-' in dot-separated labels, at most 253 bytes).
absl::Status ParseHost(std::string_view host, std::string* ip) {
  ip->clear();
  const std::string h(host);
  unsigned char addr[16];
  if (::inet_pton(AF_INET, h.c_str(), addr) == 1) {
    ip->assign(reinterpret_cast<const char*>(addr), 4);
    return absl::OkStatus();
  }
  if (::inet_pton(AF_INET6, h.c_str(), addr) == 1) {
    ip->assign(reinterpret_cast<const char*>(addr), 16);
    return absl::OkStatus();
  }
  bool ok = !h.empty() && h.size() <= 253;
  if (ok) {
    size_t start = 0;
    while (ok) {
      const size_t dot = h.find('.', start);
      ok = IsHostLabel(std::string_view(h).substr(start, dot == std::string::npos ? std::string::npos : dot - start));
      if (dot == std::string::npos) break;
      start = dot + 1;
    }
  }
  // All digits and dots is an IPv4 address gone wrong, not a name.
  if (ok && std::all_of(h.begin(), h.end(), [](char c) { return absl::ascii_isdigit(static_cast<unsigned char>(c)) || c == '.'; })) {
    ok = false;
  }
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat("host ", QuoteForMessage(host),
                                                   " is neither an IP address nor a DNS name (labels of letters, "
                                                   "digits and '-', separated by dots)"));
  }
  return absl::OkStatus();
}

std::string IpToString(const ASN1_OCTET_STRING* ip) {
  char buf[INET6_ADDRSTRLEN] = {0};
  const int len = ASN1_STRING_length(ip);
  const unsigned char* data = ASN1_STRING_get0_data(ip);
  if (len == 4) {
    ::inet_ntop(AF_INET, data, buf, sizeof(buf));
  } else if (len == 16) {
    ::inet_ntop(AF_INET6, data, buf, sizeof(buf));
  } else {
    return absl::StrCat("(", len, "-byte address)");
  }
  return buf;
}

std::string Asn1String(const ASN1_STRING* s) {
  return std::string(reinterpret_cast<const char*>(ASN1_STRING_get0_data(s)),
                     static_cast<size_t>(ASN1_STRING_length(s)));
}

absl::Status AddGeneralName(GENERAL_NAMES* names, int type, std::string_view value) {
  GENERAL_NAME* gn = GENERAL_NAME_new();
  if (gn == nullptr) return OpensslError("allocating a subjectAltName");
  ASN1_STRING* s = type == GEN_IPADD ? ASN1_OCTET_STRING_new() : ASN1_IA5STRING_new();
  if (s == nullptr || ASN1_STRING_set(s, value.data(), static_cast<int>(value.size())) != 1) {
    ASN1_STRING_free(s);
    GENERAL_NAME_free(gn);
    return OpensslError("allocating a subjectAltName");
  }
  GENERAL_NAME_set0_value(gn, type, s);
  if (sk_GENERAL_NAME_push(names, gn) == 0) {
    GENERAL_NAME_free(gn);
    return OpensslError("adding a subjectAltName");
  }
  return absl::OkStatus();
}

absl::StatusOr<X509Ptr> ParseFirstCert(std::string_view pem, size_t* count) {
  BioPtr bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  if (!bio) return OpensslError("reading PEM");
  X509Ptr first(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
  if (!first) {
    ERR_clear_error();
    return absl::InvalidArgumentError("not a PEM certificate (no readable -----BEGIN CERTIFICATE----- block)");
  }
  if (count != nullptr) {
    *count = 1;
    while (X509Ptr next{PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)}) ++*count;
    ERR_clear_error();
  }
  return first;
}

std::vector<std::string> SanOfType(X509* cert, int type) {
  std::vector<std::string> out;
  GeneralNamesPtr names(static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(cert, NID_subject_alt_name, nullptr, nullptr)));
  if (!names) return out;
  for (int i = 0; i < sk_GENERAL_NAME_num(names.get()); ++i) {
    const GENERAL_NAME* gn = sk_GENERAL_NAME_value(names.get(), i);
    if (gn->type != type) continue;
    switch (type) {
      case GEN_URI:
        out.push_back(Asn1String(gn->d.uniformResourceIdentifier));
        break;
      case GEN_DNS:
        out.push_back(Asn1String(gn->d.dNSName));
        break;
      case GEN_IPADD:
        out.push_back(IpToString(gn->d.iPAddress));
        break;
      default:
        break;
    }
  }
  return out;
}

std::string NameToString(const X509_NAME* name) {
  BioPtr bio(BIO_new(BIO_s_mem()));
  if (!bio || X509_NAME_print_ex(bio.get(), name, 0, XN_FLAG_RFC2253) < 0) return "";
  absl::StatusOr<std::string> s = BioToString(bio.get());
  return s.ok() ? *s : "";
}

// The CA of `ca_dir`, its certificate and key checked (IssueCertificate's
// contract says how).
struct Ca {
  X509Ptr cert;
  PkeyPtr key;
};

absl::StatusOr<Ca> LoadCa(const std::string& ca_dir) {
  const std::string ca_key_path = CaKeyPath(ca_dir);
  const std::string ca_cert_path = CaCertPath(ca_dir);
  CKPT_ASSIGN_OR_RETURN(const std::string ca_cert_pem, ReadCaCert(ca_cert_path, ca_dir));
  CKPT_ASSIGN_OR_RETURN(const std::string ca_key_pem, ReadCaKey(ca_key_path, ca_dir));
  Ca ca;
  absl::StatusOr<X509Ptr> cert = ParseFirstCert(ca_cert_pem, nullptr);
  if (!cert.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("CA certificate \"", ca_cert_path, "\": ", cert.status().message()));
  }
  ca.cert = *std::move(cert);
  {
    BioPtr bio(BIO_new_mem_buf(ca_key_pem.data(), static_cast<int>(ca_key_pem.size())));
    if (bio) ca.key.reset(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
    if (!ca.key) {
      ERR_clear_error();
      return absl::FailedPreconditionError(
          absl::StrCat("CA key \"", ca_key_path, "\" is not a PEM private key (an unencrypted one)"));
    }
  }
  if (X509_check_private_key(ca.cert.get(), ca.key.get()) != 1) {
    ERR_clear_error();
    return absl::FailedPreconditionError(absl::StrCat("CA key \"", ca_key_path, "\" does not belong to \"",
                                                      ca_cert_path, "\": put the pair made together there"));
  }
  if (X509_check_ca(ca.cert.get()) == 0) {
    return absl::FailedPreconditionError(absl::StrCat("\"", ca_cert_path, "\" is not a CA certificate"));
  }
  if (X509_cmp_time(X509_get0_notAfter(ca.cert.get()), nullptr) <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("CA certificate \"", ca_cert_path, "\" has expired: make a new CA and new certificates"));
  }
  return ca;
}

}  // namespace

// ---------------------------------------------------------------------------

std::string_view RoleName(Role role) {
  switch (role) {
    case Role::kMeta:
      return "meta";
    case Role::kNode:
      return "node";
    case Role::kAdmin:
      return "admin";
    case Role::kOperator:
      return "operator";
    case Role::kTrainer:
      return "trainer";
  }
  return "unknown";
}

absl::StatusOr<Role> ParseRole(std::string_view name) {
  for (Role r : {Role::kMeta, Role::kNode, Role::kAdmin, Role::kOperator, Role::kTrainer}) {
    if (RoleName(r) == name) return r;
  }
  return absl::InvalidArgumentError(absl::StrCat("role ", QuoteForMessage(name),
                                                 " is not one of meta, node, admin, operator, trainer"));
}

absl::Status ValidateJobPattern(std::string_view pattern) {
  // The rule of grpc_security.cc's trainer tokens file: "*", or a job id
  // ([a-z0-9][a-z0-9._-]{0,62}) optionally followed by '*'.
  std::string_view id = pattern;
  bool ok = true;
  if (pattern != "*") {
    if (!id.empty() && id.back() == '*') id.remove_suffix(1);
    ok = !id.empty() && id.size() <= kMaxJobIdLength;
    for (size_t i = 0; ok && i < id.size(); ++i) {
      const char c = id[i];
      const bool alnum = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9');
      ok = alnum || (i > 0 && (c == '.' || c == '_' || c == '-'));
    }
  }
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat("job pattern ", QuoteForMessage(pattern),
                                                   " is invalid: patterns are a job id ([a-z0-9][a-z0-9._-]{0,62}), "
                                                   "a job id's prefix followed by '*', or \"*\""));
  }
  return absl::OkStatus();
}

absl::Status ValidateIdentity(const Identity& identity) {
  switch (identity.role) {
    case Role::kMeta:
      if (!identity.name.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("a meta identity has no name (got ", QuoteForMessage(identity.name), ")"));
      }
      break;
    case Role::kNode:
      CKPT_RETURN_IF_ERROR(ValidateNodeId(identity.name));
      break;
    case Role::kAdmin:
    case Role::kOperator:
    case Role::kTrainer:
      CKPT_RETURN_IF_ERROR(ValidateLabel(identity.role, identity.name));
      break;
    default:
      return absl::InvalidArgumentError("unknown role");
  }
  if (!identity.host_node.empty()) {
    if (identity.role != Role::kNode) {
      return absl::InvalidArgumentError(absl::StrCat("a host (ckpt://host/", identity.host_node,
                                                     ") is for a DPU's node certificate only, not for role ",
                                                     AV(RoleName(identity.role))));
    }
    CKPT_RETURN_IF_ERROR(ValidateHostNodeId(identity.name, identity.host_node, "host node"));
  }
  if (identity.role != Role::kTrainer) {
    if (!identity.jobs.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("job patterns are for trainers only, not for role ", AV(RoleName(identity.role))));
    }
    return absl::OkStatus();
  }
  if (identity.jobs.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("trainer ", QuoteForMessage(identity.name), " has no job pattern: name at least one"));
  }
  for (size_t i = 0; i < identity.jobs.size(); ++i) {
    CKPT_RETURN_IF_ERROR(ValidateJobPattern(identity.jobs[i]));
    for (size_t k = 0; k < i; ++k) {
      if (identity.jobs[k] == identity.jobs[i]) {
        return absl::InvalidArgumentError(
            absl::StrCat("job pattern ", QuoteForMessage(identity.jobs[i]), " is given twice"));
      }
    }
  }
  return absl::OkStatus();
}

std::vector<std::string> IdentityUris(const Identity& identity) {
  std::vector<std::string> out;
  if (identity.role == Role::kMeta) {
    out.push_back(absl::StrCat(AV(kScheme), "meta"));
  } else {
    out.push_back(absl::StrCat(AV(kScheme), AV(RoleName(identity.role)), "/", identity.name));
  }
  if (identity.role == Role::kTrainer) {
    for (const std::string& job : identity.jobs) out.push_back(absl::StrCat(AV(kScheme), AV(kJobKind), "/", job));
  }
  if (!identity.host_node.empty()) out.push_back(absl::StrCat(AV(kScheme), AV(kHostKind), "/", identity.host_node));
  return out;
}

absl::StatusOr<Identity> IdentityFromUris(const std::vector<std::string>& uris) {
  std::optional<Identity> found;
  std::string role_uri;
  std::vector<std::string> jobs;
  std::optional<std::string> host;
  for (const std::string& uri : uris) {
    // The scheme is case-insensitive (RFC 3986): "CKPT://..." is ours too, and
    // must then be written exactly as IdentityUris writes it.
    if (uri.size() < kScheme.size() || !absl::EqualsIgnoreCase(AV(uri).substr(0, kScheme.size()), AV(kScheme))) {
      continue;
    }
    const auto bad = [&](std::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat("certificate URI ", QuoteForMessage(uri), ": ", AV(why)));
    };
    if (!absl::StartsWith(uri, AV(kScheme))) return bad("write the scheme as ckpt://");
    const std::string_view rest = std::string_view(uri).substr(kScheme.size());
    const size_t slash = rest.find('/');
    const std::string_view kind = rest.substr(0, slash);
    const bool has_name = slash != std::string_view::npos;
    const std::string_view name = has_name ? rest.substr(slash + 1) : std::string_view();
    if (kind == kJobKind) {
      if (!has_name) return bad("a job URI names a pattern (ckpt://job/<pattern>)");
      jobs.emplace_back(name);
      continue;
    }
    if (kind == kHostKind) {
      if (!has_name) return bad("a host URI names the host node (ckpt://host/<id>)");
      if (host.has_value()) {
        return absl::InvalidArgumentError(
            absl::StrCat("the certificate names two hosts, ", QuoteForMessage(*host), " and ", QuoteForMessage(name)));
      }
      host = std::string(name);
      continue;
    }
    absl::StatusOr<Role> role = ParseRole(kind);
    if (!role.ok()) {
      return bad("not a ckpt identity (ckpt://meta, ckpt://node/<id>, ckpt://admin/<name>, "
                 "ckpt://operator/<name>, ckpt://trainer/<name>, ckpt://job/<pattern>, ckpt://host/<id>)");
    }
    if (found.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("the certificate names two identities, ",
                                                     QuoteForMessage(role_uri), " and ", QuoteForMessage(uri)));
    }
    if (*role == Role::kMeta) {
      if (has_name) return bad("meta's URI is ckpt://meta, with nothing after it");
    } else if (!has_name) {
      return bad(absl::StrCat("a ", AV(RoleName(*role)), " URI names its holder (ckpt://", AV(kind), "/<name>)"));
    }
    found = Identity{*role, std::string(name), {}, {}};
    role_uri = uri;
  }
  if (!found.has_value()) {
    return absl::InvalidArgumentError(
        "the certificate names no ckpt identity (no ckpt://meta, ckpt://node/, ckpt://admin/, ckpt://operator/ or "
        "ckpt://trainer/ URI subjectAltName)");
  }
  found->jobs = std::move(jobs);
  if (host.has_value()) {
    if (host->empty()) return absl::InvalidArgumentError("certificate URI \"ckpt://host/\": the host node is empty");
    found->host_node = *std::move(host);
  }
  CKPT_RETURN_IF_ERROR(ValidateIdentity(*found));
  return *std::move(found);
}

absl::StatusOr<CertificateInfo> DescribeCertificate(std::string_view pem) {
  CertificateInfo info;
  CKPT_ASSIGN_OR_RETURN(X509Ptr cert, ParseFirstCert(pem, &info.chain_length));
  info.subject = NameToString(X509_get_subject_name(cert.get()));
  info.issuer = NameToString(X509_get_issuer_name(cert.get()));
  if (BnPtr bn{ASN1_INTEGER_to_BN(X509_get0_serialNumber(cert.get()), nullptr)}) {
    if (char* hex = BN_bn2hex(bn.get())) {
      info.serial_hex = absl::AsciiStrToLower(hex);
      OPENSSL_free(hex);
    }
  }
  info.not_before_unix_s = AsnTimeToUnix(X509_get0_notBefore(cert.get()));
  info.not_after_unix_s = AsnTimeToUnix(X509_get0_notAfter(cert.get()));
  if (BasicConstraintsPtr bc{static_cast<BASIC_CONSTRAINTS*>(
          X509_get_ext_d2i(cert.get(), NID_basic_constraints, nullptr, nullptr))}) {
    info.is_ca = bc->ca != 0;
  }
  info.uris = SanOfType(cert.get(), GEN_URI);
  info.dns_names = SanOfType(cert.get(), GEN_DNS);
  info.ip_addresses = SanOfType(cert.get(), GEN_IPADD);
  if (EkuPtr eku{static_cast<EXTENDED_KEY_USAGE*>(
          X509_get_ext_d2i(cert.get(), NID_ext_key_usage, nullptr, nullptr))}) {
    for (int i = 0; i < sk_ASN1_OBJECT_num(eku.get()); ++i) {
      const int nid = OBJ_obj2nid(sk_ASN1_OBJECT_value(eku.get(), i));
      info.extended_key_usages.push_back(nid == NID_undef ? "unknown" : OBJ_nid2sn(nid));
    }
  }
  info.identity = IdentityFromUris(info.uris);
  ERR_clear_error();
  return info;
}

absl::StatusOr<Identity> IdentityOfCertificate(std::string_view pem) {
  CKPT_ASSIGN_OR_RETURN(X509Ptr cert, ParseFirstCert(pem, nullptr));
  return IdentityFromUris(SanOfType(cert.get(), GEN_URI));
}

absl::StatusOr<Identity> IdentityOfCertificateDer(std::string_view der) {
  const auto* p = reinterpret_cast<const unsigned char*>(der.data());
  X509Ptr cert(d2i_X509(nullptr, &p, static_cast<long>(der.size())));
  if (!cert || p != reinterpret_cast<const unsigned char*>(der.data()) + der.size()) {
    ERR_clear_error();
    return absl::InvalidArgumentError("not a DER certificate");
  }
  return IdentityFromUris(SanOfType(cert.get(), GEN_URI));
}

std::string CaCertPath(const std::string& ca_dir) { return ca_dir + "/ca.pem"; }
std::string CaKeyPath(const std::string& ca_dir) { return ca_dir + "/ca.key"; }
std::string CertPath(const std::string& out_prefix) { return out_prefix + ".pem"; }
std::string KeyPath(const std::string& out_prefix) { return out_prefix + ".key"; }

absl::Status CreateCa(const std::string& dir, const CaOptions& options) {
  CKPT_RETURN_IF_ERROR(CheckDays(options.days));
  if (options.name.empty() || options.name.size() > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("CA name ", QuoteForMessage(options.name), " must be 1 to 64 bytes long"));
  }
  if (dir.empty()) return absl::InvalidArgumentError("the CA directory is empty");
  CKPT_RETURN_IF_ERROR(MakeDirs(dir));
  NewFiles files;
  CKPT_ASSIGN_OR_RETURN(const size_t cert_file, files.Claim(CaCertPath(dir), 0644));
  CKPT_ASSIGN_OR_RETURN(const size_t key_file, files.Claim(CaKeyPath(dir), 0600));

  CKPT_ASSIGN_OR_RETURN(PkeyPtr key, NewKey());
  X509Ptr cert(X509_new());
  if (!cert || X509_set_version(cert.get(), 2) != 1) return OpensslError("creating the CA certificate");
  CKPT_RETURN_IF_ERROR(SetRandomSerial(cert.get()));
  CKPT_RETURN_IF_ERROR(SetValidity(cert.get(), options.days, nullptr));
  CKPT_RETURN_IF_ERROR(SetCommonName(X509_get_subject_name(cert.get()), options.name));
  if (X509_set_issuer_name(cert.get(), X509_get_subject_name(cert.get())) != 1 ||
      X509_set_pubkey(cert.get(), key.get()) != 1) {
    return OpensslError("creating the CA certificate");
  }
  CKPT_RETURN_IF_ERROR(AddExtension(cert.get(), cert.get(), NID_basic_constraints, "critical,CA:TRUE,pathlen:0"));
  CKPT_RETURN_IF_ERROR(AddExtension(cert.get(), cert.get(), NID_key_usage, "critical,keyCertSign,cRLSign"));
  CKPT_RETURN_IF_ERROR(AddExtension(cert.get(), cert.get(), NID_subject_key_identifier, "hash"));
  if (X509_sign(cert.get(), key.get(), EVP_sha256()) <= 0) return OpensslError("signing the CA certificate");

  CKPT_ASSIGN_OR_RETURN(const std::string key_pem, KeyToPem(key.get()));
  CKPT_ASSIGN_OR_RETURN(const std::string cert_pem, CertToPem(cert.get()));
  CKPT_RETURN_IF_ERROR(files.Write(key_file, key_pem));
  CKPT_RETURN_IF_ERROR(files.Write(cert_file, cert_pem));
  return files.Commit(dir);
}

absl::Status IssueCertificate(const std::string& ca_dir, const CertOptions& options, const std::string& out_prefix) {
  const Identity& id = options.identity;
  CKPT_RETURN_IF_ERROR(ValidateIdentity(id));
  CKPT_RETURN_IF_ERROR(CheckDays(options.days));
  const bool server = id.role == Role::kMeta || id.role == Role::kNode;
  if (server && options.hosts.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a ", AV(RoleName(id.role)),
        " certificate needs at least one host (the names or addresses it is reached at: callers check them)"));
  }
  std::vector<std::pair<std::string, std::string>> hosts;  // (host, ip bytes or empty)
  for (const std::string& h : options.hosts) {
    std::string ip;
    CKPT_RETURN_IF_ERROR(ParseHost(h, &ip));
    for (const auto& [other, other_ip] : hosts) {
      if (other == h || (!ip.empty() && other_ip == ip)) {
        return absl::InvalidArgumentError(absl::StrCat("host ", QuoteForMessage(h), " is given twice"));
      }
    }
    hosts.emplace_back(h, std::move(ip));
  }
  if (out_prefix.empty()) return absl::InvalidArgumentError("the output prefix is empty");

  // The CA, checked before any output file is created.
  CKPT_ASSIGN_OR_RETURN(Ca ca, LoadCa(ca_dir));

  const std::string cert_path = CertPath(out_prefix);
  const std::string key_path = KeyPath(out_prefix);
  const std::string out_dir = DirOf(out_prefix);
  CKPT_RETURN_IF_ERROR(MakeDirs(out_dir));
  NewFiles files;
  CKPT_ASSIGN_OR_RETURN(const size_t cert_file, files.Claim(cert_path, 0644));
  CKPT_ASSIGN_OR_RETURN(const size_t key_file, files.Claim(key_path, 0600));

  CKPT_ASSIGN_OR_RETURN(PkeyPtr key, NewKey());
  X509Ptr cert(X509_new());
  if (!cert || X509_set_version(cert.get(), 2) != 1) return OpensslError("creating the certificate");
  CKPT_RETURN_IF_ERROR(SetRandomSerial(cert.get()));
  CKPT_RETURN_IF_ERROR(SetValidity(cert.get(), options.days, X509_get0_notAfter(ca.cert.get())));
  const std::vector<std::string> uris = IdentityUris(id);
  CKPT_RETURN_IF_ERROR(SetCommonName(X509_get_subject_name(cert.get()), uris.front()));
  if (X509_set_issuer_name(cert.get(), X509_get_subject_name(ca.cert.get())) != 1 ||
      X509_set_pubkey(cert.get(), key.get()) != 1) {
    return OpensslError("creating the certificate");
  }
  CKPT_RETURN_IF_ERROR(AddExtension(cert.get(), ca.cert.get(), NID_basic_constraints, "critical,CA:FALSE"));
  CKPT_RETURN_IF_ERROR(
      AddExtension(cert.get(), ca.cert.get(), NID_key_usage, "critical,digitalSignature,keyAgreement"));
  CKPT_RETURN_IF_ERROR(AddExtension(cert.get(), ca.cert.get(), NID_ext_key_usage,
                                    server ? "serverAuth,clientAuth" : "clientAuth"));
  CKPT_RETURN_IF_ERROR(AddExtension(cert.get(), ca.cert.get(), NID_subject_key_identifier, "hash"));
  CKPT_RETURN_IF_ERROR(AddExtension(cert.get(), ca.cert.get(), NID_authority_key_identifier, "keyid:always"));
  {
    // subjectAltName built from values, not from a config string, so no name
    // can smuggle a second entry in.
    GeneralNamesPtr names(sk_GENERAL_NAME_new_null());
    if (!names) return OpensslError("allocating subjectAltName");
    for (const std::string& uri : uris) CKPT_RETURN_IF_ERROR(AddGeneralName(names.get(), GEN_URI, uri));
    for (const auto& [host, ip] : hosts) {
      CKPT_RETURN_IF_ERROR(ip.empty() ? AddGeneralName(names.get(), GEN_DNS, host)
                                      : AddGeneralName(names.get(), GEN_IPADD, ip));
    }
    // Critical when the subject is empty (RFC 5280 4.2.1.6); ours never is.
    if (X509_add1_ext_i2d(cert.get(), NID_subject_alt_name, names.get(), 0, X509V3_ADD_DEFAULT) != 1) {
      return OpensslError("adding subjectAltName");
    }
  }
  if (X509_sign(cert.get(), ca.key.get(), EVP_sha256()) <= 0) return OpensslError("signing the certificate");

  CKPT_ASSIGN_OR_RETURN(const std::string key_pem, KeyToPem(key.get()));
  CKPT_ASSIGN_OR_RETURN(const std::string leaf_pem, CertToPem(cert.get()));
  CKPT_ASSIGN_OR_RETURN(const std::string ca_pem, CertToPem(ca.cert.get()));
  CKPT_RETURN_IF_ERROR(files.Write(key_file, key_pem));
  CKPT_RETURN_IF_ERROR(files.Write(cert_file, leaf_pem + ca_pem));
  return files.Commit(out_dir);
}


absl::StatusOr<CrlInfo> RevokeCertificates(const std::string& ca_dir, const std::vector<std::string>& cert_files,
                                           const std::string& crl_dir, int days) {
  CKPT_RETURN_IF_ERROR(CheckDays(days));
  if (crl_dir.empty()) return absl::InvalidArgumentError("the CRL directory is empty");
  CKPT_ASSIGN_OR_RETURN(Ca ca, LoadCa(ca_dir));
  EVP_PKEY* const ca_pub = X509_get0_pubkey(ca.cert.get());

  // The certificates to revoke: each one this CA's.
  std::vector<X509Ptr> certs;
  for (const std::string& file : cert_files) {
    absl::StatusOr<std::string> pem = ReadFileToString(PosixFileSystem(), file);
    if (!pem.ok()) {
      if (absl::IsNotFound(pem.status())) {
        return absl::NotFoundError(absl::StrCat("certificate \"", file, "\" does not exist"));
      }
      return pem.status();
    }
    absl::StatusOr<X509Ptr> cert = ParseFirstCert(*pem, nullptr);
    if (!cert.ok()) return absl::InvalidArgumentError(absl::StrCat("\"", file, "\": ", cert.status().message()));
    if (X509_check_issued(ca.cert.get(), cert->get()) != X509_V_OK || X509_verify(cert->get(), ca_pub) != 1) {
      ERR_clear_error();
      return absl::InvalidArgumentError(
          absl::StrCat("\"", file, "\" was not issued by the CA in \"", ca_dir, "\": nothing to revoke there"));
    }
    certs.push_back(*std::move(cert));
  }

  CrlInfo info;
  char hash[16];
  std::snprintf(hash, sizeof(hash), "%08lx", X509_NAME_hash_ex(X509_get_subject_name(ca.cert.get()), nullptr,
                                                               nullptr, nullptr));
  info.path = absl::StrCat(crl_dir, "/", hash, ".r0");

  // What the CA's list revokes already (its own list only: one signed by
  // another key is refused rather than replaced).
  using CrlPtr = std::unique_ptr<X509_CRL, Deleter<X509_CRL, X509_CRL_free>>;
  CrlPtr old;
  if (absl::StatusOr<std::string> text = ReadFileToString(PosixFileSystem(), info.path); text.ok()) {
    BioPtr bio(BIO_new_mem_buf(text->data(), static_cast<int>(text->size())));
    if (bio) old.reset(PEM_read_bio_X509_CRL(bio.get(), nullptr, nullptr, nullptr));
    if (!old || X509_CRL_verify(old.get(), ca_pub) != 1) {
      ERR_clear_error();
      return absl::FailedPreconditionError(absl::StrCat("\"", info.path,
                                                        "\" is not a CRL this CA signed: move it away first"));
    }
  } else if (!absl::IsNotFound(text.status())) {
    return text.status();
  }

  CrlPtr crl(X509_CRL_new());
  using TimePtr = std::unique_ptr<ASN1_TIME, Deleter<ASN1_TIME, ASN1_TIME_free>>;
  const time_t now = std::time(nullptr);
  TimePtr last(ASN1_TIME_set(nullptr, now - kBackdateSeconds));
  TimePtr next(ASN1_TIME_set(nullptr, now + static_cast<time_t>(days) * 86400));
  TimePtr revoked_at(ASN1_TIME_set(nullptr, now));
  if (!crl || !last || !next || !revoked_at || X509_CRL_set_version(crl.get(), 1) != 1 ||
      X509_CRL_set_issuer_name(crl.get(), X509_get_subject_name(ca.cert.get())) != 1 ||
      X509_CRL_set1_lastUpdate(crl.get(), last.get()) != 1 || X509_CRL_set1_nextUpdate(crl.get(), next.get()) != 1) {
    return OpensslError("creating the CRL");
  }
  std::vector<std::string> listed;
  auto add = [&](const ASN1_INTEGER* serial, const ASN1_TIME* when) -> absl::Status {
    BnPtr bn(ASN1_INTEGER_to_BN(serial, nullptr));
    char* hex = bn ? BN_bn2hex(bn.get()) : nullptr;
    if (hex == nullptr) return OpensslError("reading a serial number");
    std::string serial_hex = absl::AsciiStrToLower(hex);
    OPENSSL_free(hex);
    if (std::find(listed.begin(), listed.end(), serial_hex) != listed.end()) return absl::OkStatus();
    X509_REVOKED* r = X509_REVOKED_new();
    if (r == nullptr || X509_REVOKED_set_serialNumber(r, const_cast<ASN1_INTEGER*>(serial)) != 1 ||
        X509_REVOKED_set_revocationDate(r, const_cast<ASN1_TIME*>(when)) != 1 ||
        X509_CRL_add0_revoked(crl.get(), r) != 1) {
      X509_REVOKED_free(r);
      return OpensslError("listing a revoked certificate");
    }
    listed.push_back(std::move(serial_hex));
    return absl::OkStatus();
  };
  if (old) {
    STACK_OF(X509_REVOKED)* before = X509_CRL_get_REVOKED(old.get());
    for (int i = 0; i < sk_X509_REVOKED_num(before); ++i) {
      const X509_REVOKED* r = sk_X509_REVOKED_value(before, i);
      CKPT_RETURN_IF_ERROR(add(X509_REVOKED_get0_serialNumber(r), X509_REVOKED_get0_revocationDate(r)));
    }
  }
  const size_t had = listed.size();
  for (const X509Ptr& cert : certs) {
    CKPT_RETURN_IF_ERROR(add(X509_get0_serialNumber(cert.get()), revoked_at.get()));
  }
  info.newly_revoked = listed.size() - had;
  info.revoked_serials_hex = listed;
  info.next_update_unix_s = static_cast<int64_t>(now) + static_cast<int64_t>(days) * 86400;
  if (X509_CRL_sort(crl.get()) != 1 || X509_CRL_sign(crl.get(), ca.key.get(), EVP_sha256()) <= 0) {
    return OpensslError("signing the CRL");
  }
  BioPtr out(BIO_new(BIO_s_mem()));
  if (!out || PEM_write_bio_X509_CRL(out.get(), crl.get()) != 1) return OpensslError("encoding the CRL");
  CKPT_ASSIGN_OR_RETURN(const std::string pem, BioToString(out.get()));
  if (::mkdir(crl_dir.c_str(), 0755) != 0 && errno != EEXIST) return PosixErrorToStatus(errno, "mkdir", crl_dir);
  CKPT_RETURN_IF_ERROR(WriteStringToFileAtomically(PosixFileSystem(), info.path, pem));
  return info;
}

}  // namespace ckpt::pki
