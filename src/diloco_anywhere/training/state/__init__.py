"""What a replica's model state is and where it starts: the global state tree, its names and
fingerprint, the warm and the voted initial start, the files added to the export."""
