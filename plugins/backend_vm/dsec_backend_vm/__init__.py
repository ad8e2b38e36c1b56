"""dsec VM backend plugin: full virtual machines under QEMU (q35) with a display. So far its
display side: screenshots and input over QMP (``screen``), the guest kernel and devices that
give a VM a framebuffer and evdev input (``display``) and guest test programs (``guest``).
The backend itself registers here once it exists."""
