"""Just enough ELF to read a kernel module's ``.modinfo`` section and to tell a static program
from a dynamic one: section and program headers of 32- and 64-bit, either byte order."""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["ElfError", "ElfFile"]

_PT_INTERP = 3


class ElfError(ValueError):
    """The bytes are not an ELF file, or its headers point outside it."""


@dataclass(frozen=True)
class _Layout:
    """Where an ELF class keeps its header fields (offsets into the file header and formats)."""

    header: str  # at header_at: e_phoff, e_shoff, e_phentsize, e_phnum, e_shentsize, ...
    header_at: int
    section: str  # sh_name, sh_type, sh_offset, sh_size
    program: str  # p_type, p_offset


_LAYOUTS = {
    1: _Layout("I I 4x 2x H H H H H", 28, "I I 8x I I", "I"),
    2: _Layout("Q Q 4x 2x H H H H H", 32, "I I 16x Q Q", "I"),
}


class ElfFile:
    """An ELF image held in memory; ``sections`` maps section names to their bytes."""

    def __init__(self, data: bytes) -> None:
        if data[:4] != b"\x7fELF" or len(data) < 64 or data[4] not in _LAYOUTS:
            raise ElfError("not an ELF file")
        self._data = data
        self._order = "<" if data[5] == 1 else ">"
        self._layout = _LAYOUTS[data[4]]
        fields = self._unpack(self._layout.header, self._layout.header_at)
        self._phoff, self._shoff, self._phentsize, self._phnum = fields[:4]
        self._shentsize, self._shnum, shstrndx = fields[4:]
        self._sections = self._read_sections(shstrndx)

    def _unpack(self, fmt: str, offset: int) -> tuple[int, ...]:
        fmt = self._order + fmt.replace(" ", "")
        if offset < 0 or offset + struct.calcsize(fmt) > len(self._data):
            raise ElfError("ELF header points past the end of the file")
        return struct.unpack_from(fmt, self._data, offset)

    def _slice(self, offset: int, size: int) -> bytes:
        if offset + size > len(self._data):
            raise ElfError("ELF section points past the end of the file")
        return self._data[offset : offset + size]

    def _read_sections(self, shstrndx: int) -> dict[str, bytes]:
        headers = [
            self._unpack(self._layout.section, self._shoff + i * self._shentsize)
            for i in range(self._shnum)
        ]
        if not headers:
            return {}
        if shstrndx >= len(headers):
            raise ElfError("ELF section name table index out of range")
        _, _, names_at, names_size = headers[shstrndx]
        names = self._slice(names_at, names_size)
        out = {}
        for name_at, _type, offset, size in headers:
            name = names[name_at : names.find(b"\0", name_at)].decode(errors="replace")
            # SHT_NOBITS (.bss) has a size but no bytes in the file
            out[name] = b"" if _type == 8 else self._slice(offset, size)
        return out

    @property
    def sections(self) -> dict[str, bytes]:
        return self._sections

    def modinfo(self) -> dict[str, list[str]]:
        """A kernel module's ``.modinfo`` as ``key -> values`` (``alias`` and ``parm`` repeat);
        empty for a file without one."""
        out: dict[str, list[str]] = {}
        for item in self._sections.get(".modinfo", b"").split(b"\0"):
            key, eq, value = item.decode(errors="replace").partition("=")
            if eq:
                out.setdefault(key, []).append(value)
        return out

    def is_dynamic(self) -> bool:
        """True if the program asks for a dynamic loader (a ``PT_INTERP`` header)."""
        return any(
            self._unpack(self._layout.program, self._phoff + i * self._phentsize)[0] == _PT_INTERP
            for i in range(self._phnum)
        )
