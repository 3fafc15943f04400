# A raw GPT disk image that boots under SeaBIOS and OVMF alike, made from files only (no loop
# device, no mount): sourced by scripts/build-test-os-image and scripts/build-node-image.
# Callers set `set -euo pipefail`, define log(), and need sgdisk, mkfs.vfat, mtools, mkfs.ext4
# and GRUB's i386-pc and x86_64-efi files (grub-pc-bin, grub-efi-amd64-bin).
#
#   partition 1  BIOS boot (1 MiB): GRUB's i386-pc core.img; the MBR holds GRUB's boot.img
#   partition 2  EFI system (16 MiB, FAT): GRUB's x86_64-efi image as /EFI/BOOT/BOOTX64.EFI
#   partition 3  root (ext4 with the given label, the rest of the disk: the LAST partition, so
#                the deploy agent can grow it)
# Both GRUB images find the root by its label and read /boot/grub/grub.cfg there.

# depmod, mkfs.* and sgdisk are in sbin, which a user's PATH on Debian lacks.
PATH="$PATH:/usr/sbin:/sbin"

BOOTABLE_DISK_GRUB=/usr/lib/grub
# GRUB modules in both images: find the root by label on GPT/ext4, read grub.cfg, boot Linux.
BOOTABLE_DISK_GRUB_MODULES=(part_gpt ext2 search search_label normal configfile linux boot echo test serial terminal)
BOOTABLE_DISK_ESP_MIB=16

# The files the disk's boot code comes from, for the callers' cache keys: one sha256 per line.
bootable_disk_inputs() {
	(cd "$BOOTABLE_DISK_GRUB" && find i386-pc x86_64-efi -type f -print0 | sort -z | xargs -0 sha256sum)
}

# Checks the tools and GRUB files are here; says what installs them when not.
bootable_disk_check() {
	local tool dir
	for tool in grub-mkimage sgdisk mkfs.vfat mcopy mkfs.ext4; do
		command -v "$tool" >/dev/null || { log "$tool is missing (scripts/setup installs it)"; return 1; }
	done
	for dir in "$BOOTABLE_DISK_GRUB/i386-pc" "$BOOTABLE_DISK_GRUB/x86_64-efi"; do
		[[ -d "$dir" ]] || { log "$dir is missing (scripts/setup installs grub-pc-bin and grub-efi-amd64-bin)"; return 1; }
	done
}

# bootable_disk <disk> <size MiB> <root label> <root tree> <scratch dir>
# Writes <disk> (<size MiB> in all) whose root file system holds <root tree>, which must have
# /boot/grub/grub.cfg.
bootable_disk() {
	local disk="$1" size_mib="$2" label="$3" tree="$4" scratch="$5"
	local grub="$BOOTABLE_DISK_GRUB"
	[[ -f "$tree/boot/grub/grub.cfg" ]] || { log "$tree has no /boot/grub/grub.cfg"; return 1; }
	mkdir -p "$scratch"

	# GRUB: both images run the same early configuration, then $prefix/grub.cfg.
	printf 'search --no-floppy --label --set=root %s\nset prefix=($root)/boot/grub\n' "$label" >"$scratch/early.cfg"
	grub-mkimage -O i386-pc -d "$grub/i386-pc" -o "$scratch/core.img" -c "$scratch/early.cfg" \
		-p /boot/grub biosdisk "${BOOTABLE_DISK_GRUB_MODULES[@]}"
	# efi_gop: the video mode Linux is handed (without it GRUB prints an error, harmless).
	grub-mkimage -O x86_64-efi -d "$grub/x86_64-efi" -o "$scratch/bootx64.efi" -c "$scratch/early.cfg" \
		-p /boot/grub efi_gop "${BOOTABLE_DISK_GRUB_MODULES[@]}"

	# The partition table.
	rm -f "$disk"
	truncate -s "${size_mib}M" "$disk"
	sgdisk -o -n 1:2048:+1M -t 1:EF02 -c 1:bios-boot \
		-n "2:0:+${BOOTABLE_DISK_ESP_MIB}M" -t 2:EF00 -c 2:esp \
		-n 3:0:0 -t 3:8300 -c 3:root "$disk" >/dev/null
	first() { sgdisk -i "$1" "$disk" | awk '/^First sector:/ { print $3 }'; }
	sectors() { sgdisk -i "$1" "$disk" | awk '/^Partition size:/ { print $3 }'; }
	put() { dd if="$2" of="$disk" bs=512 seek="$(first "$1")" conv=notrunc,sparse status=none; }

	# BIOS: boot.img in the MBR (its first 440 bytes: the rest is the protective MBR's
	# partition table) loads the first sector of core.img (diskboot.img), which loads the rest.
	# grub-bios-setup would patch the same fields, but it wants a device.
	local core_sectors core_lba
	core_sectors=$((($(stat -c %s "$scratch/core.img") + 511) / 512))
	[[ "$core_sectors" -le "$(sectors 1)" ]] || { log "core.img ($core_sectors sectors) does not fit partition 1"; return 1; }
	core_lba="$(first 1)"
	le64() { printf "$(printf '\\x%02x' $(($1 & 255)) $((($1 >> 8) & 255)) $((($1 >> 16) & 255)) $((($1 >> 24) & 255)) 0 0 0 0)"; }
	cp "$grub/i386-pc/boot.img" "$scratch/boot.img"
	# GRUB_BOOT_MACHINE_KERNEL_SECTOR (0x5c): where core.img starts.
	le64 "$core_lba" | dd of="$scratch/boot.img" bs=1 seek=$((0x5c)) conv=notrunc status=none
	# GRUB_BOOT_MACHINE_DRIVE_CHECK (0x66): a hard disk, so nop out the jump that trusts the
	# BIOS's drive number only for floppies (what grub-bios-setup does for a disk).
	printf '\x90\x90' | dd of="$scratch/boot.img" bs=1 seek=$((0x66)) conv=notrunc status=none
	dd if="$scratch/boot.img" of="$disk" bs=440 count=1 conv=notrunc status=none
	# diskboot.img's block list (the last 12 bytes of its sector: start, count, segment):
	# grub-mkimage filled in the count; the rest of core.img follows its first sector.
	le64 $((core_lba + 1)) | dd of="$scratch/core.img" bs=1 seek=$((512 - 12)) conv=notrunc status=none
	put 1 "$scratch/core.img"

	# UEFI: the removable-media path, which firmware boots without any boot entry.
	local esp="$scratch/esp.img"
	rm -f "$esp"
	mkfs.vfat -C -n ESP "$esp" $(($(sectors 2) / 2)) >/dev/null
	mmd -i "$esp" ::/EFI ::/EFI/BOOT
	mcopy -i "$esp" "$scratch/bootx64.efi" ::/EFI/BOOT/BOOTX64.EFI
	put 2 "$esp"

	# GRUB 2.06 cannot read ext4's orphan_file; metadata_csum_seed neither.
	local root="$scratch/root.img"
	rm -f "$root"
	truncate -s $(($(sectors 3) * 512)) "$root"
	mkfs.ext4 -q -F -L "$label" -O ^orphan_file,^metadata_csum_seed -E root_owner=0:0 -d "$tree" "$root"
	put 3 "$root"
	rm -f "$root" "$esp"
	sgdisk -v "$disk" | grep -q "No problems found" || { sgdisk -v "$disk" >&2; return 1; }
}
