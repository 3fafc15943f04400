# Shell functions the image builders share (sourced by scripts/build-ramdisk and
# scripts/build-test-os-image): the Debian kernel package, its modules in load order, and a
# gzip'd newc initramfs. Callers set `set -euo pipefail` and define log().

# depmod, mkfs.* and sgdisk are in sbin, which a user's PATH on Debian lacks (no root needed).
PATH="$PATH:/usr/sbin:/sbin"

# The kernel package linux-image-amd64 depends on, as apt would install it now:
# "<package> <version> <sha256 of the .deb>". That sha256 is an input of the callers' cache
# keys: a new Debian kernel means a new image, while an unchanged one costs no download.
kernel_package() {
	local package
	package="$(apt-cache show --no-all-versions linux-image-amd64 2>/dev/null |
		awk -F': ' '/^Depends:/ { split($2, d, /[ ,]/); print d[1]; exit }')"
	[[ -n "$package" ]] || { log "apt knows no linux-image-amd64 (run apt-get update)"; return 1; }
	apt-cache show --no-all-versions "$package" |
		awk -v p="$package" -F': ' '/^Version:/ { v = $2 } /^SHA256:/ { s = $2 } END { print p, v, s }'
}

# Downloads the .deb "<package> <version> <sha256>" with apt-get download into $1, kept there
# as <sha256>.deb, and checks it against that sha256. Returns non-zero when apt cannot get it.
download_deb() {
	local debs="$1" package="$2" version="$3" sha256="$4"
	local tmp
	mkdir -p "$debs"
	tmp="$(mktemp -d "$debs/.download.XXXXXX")"
	log "apt-get download $package=$version"
	# As root apt would drop to its _apt user, who cannot write here; it then warns and
	# downloads as root anyway.
	if (cd "$tmp" && apt-get download -q -o APT::Sandbox::User=root "$package=$version" >&2) &&
		echo "$sha256  $(ls "$tmp"/*.deb)" | sha256sum -c --quiet >&2; then
		mv "$tmp"/*.deb "$debs/$sha256.deb"
		rm -rf "$tmp"
		return 0
	fi
	rm -rf "$tmp"
	log "apt-get download $package=$version failed"
	return 1
}

# Prints the path of the kernel .deb "<package> <version> <sha256>" (kernel_package) in $1,
# downloaded there unless it already is.
kernel_deb() {
	local debs="$1" package="$2" version="$3" sha256="$4"
	[[ -f "$debs/$sha256.deb" ]] || download_deb "$debs" "$package" "$version" "$sha256" || return 1
	echo "$debs/$sha256.deb"
}

# When apt's lists are missing or old (Debian removes a kernel package from its mirrors when
# the next one comes out), updates them, as root and once per build (the caller then starts
# over with the kernel they name). Returns non-zero when it did not.
refresh_apt_lists() {
	[[ "$(id -u)" -eq 0 && -z "${SITEBOOT_APT_UPDATED:-}" ]] || return 1
	log "apt-get update (apt's lists do not name a kernel the mirror has)"
	apt-get update -q >&2 || return 1
	export SITEBOOT_APT_UPDATED=1
}

# Unpacks the kernel and its modules from the .deb $1 into $2 and indexes the modules'
# dependencies (modules.dep: made by depmod when the package is installed, not shipped in it);
# prints the kernel version.
unpack_kernel() {
	local deb="$1" dir="$2"
	mkdir -p "$dir"
	dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$dir" --wildcards './boot/vmlinuz-*' './lib/modules/*'
	local versions=("$dir"/lib/modules/*)
	[[ ${#versions[@]} -eq 1 ]] || { log "$deb: expected one module tree, found ${#versions[@]}"; return 1; }
	depmod -b "$dir" "$(basename "${versions[0]}")"
	basename "${versions[0]}"
}

# Prints the files (relative to the module tree $1) of the modules named in $2.. and of what
# they depend on (modules.dep lists every module's dependencies transitively, last loaded
# first), in an order insmod can load them. Modules built into the kernel are skipped; a
# module the kernel has neither built in nor as a file is an error.
module_load_order() {
	local tree="$1"
	shift
	awk -v want="$*" '
		function name(path,  n) { n = path; sub(/.*\//, "", n); sub(/\.ko(\.[a-z]+)?$/, "", n); gsub(/-/, "_", n); return n }
		function emit(path) { if (!(path in seen)) { seen[path] = 1; print path } }
		FILENAME ~ /modules\.builtin$/ { builtin[name($1)] = 1; next }
		{ path = $1; sub(/:$/, "", path); n = name(path); file[n] = path; deps[n] = ""
		  for (i = 2; i <= NF; i++) deps[n] = deps[n] " " $i }
		END {
			count = split(want, wanted, " ")
			for (i = 1; i <= count; i++) {
				n = wanted[i]; gsub(/-/, "_", n)
				if (n in builtin) continue
				if (!(n in file)) { print "no module " n " in this kernel" > "/dev/stderr"; missing = 1; continue }
				c = split(deps[n], d, " ")
				for (j = c; j >= 1; j--) emit(d[j])
				emit(file[n])
			}
			exit missing
		}' "$tree/modules.builtin" "$tree/modules.dep"
}

# Copies the modules of module_load_order (the list in $3..) from the tree $1 into the
# initramfs root $2 under /lib/modules/<version>/, decompressed, and writes their load order
# (absolute paths) to $2/etc/modules.
install_modules() {
	local tree="$1" root="$2"
	shift 2
	local order version path
	version="$(basename "$tree")"
	order="$(module_load_order "$tree" "$@")"
	mkdir -p "$root/etc"
	: >"$root/etc/modules"
	while read -r path; do
		local out="$root/lib/modules/$version/${path%.ko*}.ko"
		mkdir -p "$(dirname "$out")"
		case "$path" in
			*.ko) cp "$tree/$path" "$out" ;;
			*.ko.xz) xz -dc "$tree/$path" >"$out" ;;
			*.ko.zst) zstd -dcq "$tree/$path" >"$out" ;;
			*.ko.gz) gzip -dc "$tree/$path" >"$out" ;;
			*) log "unknown module compression: $path"; return 1 ;;
		esac
		echo "/lib/modules/$version/${path%.ko*}.ko" >>"$root/etc/modules"
	done <<<"$order"
}

# Writes the gzip'd newc archive of the tree $1 (owned by root, mtime 0) to $2. The archive
# starts with /dev/console, a device node made without mknod (so without root), because the
# kernel opens it for init's stdin/stdout before anything is mounted.
pack_initramfs() {
	local root="$1" out="$2"
	{
		newc_entry 1 040755 dev 0 0
		newc_entry 2 020600 dev/console 5 1
		newc_entry 0 0 'TRAILER!!!' 0 0
		find "$root" -exec touch -h -d @0 {} +
		(cd "$root" && find . -mindepth 1 -printf '%P\n' | LC_ALL=C sort |
			cpio --quiet -o -H newc -R 0:0 --reproducible)
	} | gzip -9n >"$out"
}

# One empty newc entry: inode, mode (octal), name, rdev major and minor.
newc_entry() {
	local name="$3" pad
	printf '070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%s\0' \
		"$1" "$((8#$2))" 0 0 1 0 0 0 0 "$4" "$5" "$((${#name} + 1))" 0 "$name"
	# Header (110 bytes) and name padded to a multiple of 4.
	pad=$(((4 - (110 + ${#name} + 1) % 4) % 4))
	head -c "$pad" /dev/zero
}
